"""`chatloom serve`, `chatloom keys ...` and other product subcommands (filled in by the app)."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the product's commands to the top-level parser."""
