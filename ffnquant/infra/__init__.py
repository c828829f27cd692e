"""What every command stands on: atomic files and output folders (`atomic`, `atomic_folder`), checks made before an
input is read (`resources`), the environment stamp (`envinfo`), table and number formatting (`render`) and
third-party log noise kept quiet (`thirdparty`). A core subpackage."""
