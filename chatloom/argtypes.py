"""argparse types shared by every `chatloom` subcommand: a bad value is one clear line."""
from __future__ import annotations

import argparse
import math
from typing import Callable


def int_at_least(lo: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{what}, got {value}")
        return value
    return parse


def float_in(lo: float, hi: float, what: str, lo_open: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < lo or value > hi or (lo_open and value == lo):
            raise argparse.ArgumentTypeError(f"{what}, got {text}")
        return value
    return parse


def slowdown(text: str) -> float:
    """A fraction of at least 0, or inf (no pacing): engine.encoder_max_slowdown."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or inf, got {text!r}") from None
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be at least 0 (or inf), got {text}")
    return value


positive_int = int_at_least(1, "must be at least 1")
positive_float = float_in(0.0, math.inf, "must be a positive number", lo_open=True)
nonnegative_float = float_in(0.0, math.inf, "must be at least 0")
