"""The `chatloom` command and its subcommands, one module per group: `main` (the parser; generate
and chat), `model_info` (models and capacity), `serve` (serve, keys, users), `fleet` (serve's fleet
flags), `replica`, `bench`, `sim` (sim and plan).

`python -m chatloom.cli` runs the same command as the `chatloom` entry point.
"""
