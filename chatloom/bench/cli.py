"""`chatloom bench ...` subcommands (filled in by the engine benchmarks)."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `bench` command and its subcommands to the top-level parser."""
    p = subparsers.add_parser("bench", help="benchmarks that print JSON")
    p.add_subparsers(dest="bench_command", metavar="BENCH")
