"""The `chatloom` command and its subcommands, one module per group: `main` (the parser, and the
model commands generate, chat, models), `serve` (serve, keys, users), `fleet` (serve's fleet flags),
`replica`, `bench`, `sim` (sim and plan).

`python -m chatloom.cli` runs the same command as the `chatloom` entry point.
"""
