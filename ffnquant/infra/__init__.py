"""What every command stands on: atomic files and output folders (`atomic`, `atomic_folder`), checks made before an
input is read (`resources`, and `arguments`: one check per kind of argument for the CLI and the API), the environment stamp (`envinfo`), table and number formatting (`render`) and
third-party log noise kept quiet (`thirdparty`). A core subpackage."""
