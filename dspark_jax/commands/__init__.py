"""Subcommands of the `dspark-jax` console script (registered in `dspark_jax.cli.COMMANDS`)."""
