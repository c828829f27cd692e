"""CLI subcommands, one module each (see ffnquant.cli.COMMANDS)."""
