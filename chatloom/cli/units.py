"""Numbers and byte counts as the commands print them."""
from __future__ import annotations


def fmt_int(n: int) -> str:
    return f"{n:,}"


def fmt_binary(n: float) -> str:
    """Bytes in binary units: 327680 -> '320 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.3g} {unit}"


def fmt_decimal(n: float) -> str:
    """Bytes in decimal units: 2621440000 -> '2.62 GB'."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            break
        n /= 1000
    return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.3g} {unit}"


def fmt_params(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)
