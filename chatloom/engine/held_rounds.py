"""A round kept while its tools run: the record the KV-cache manager adopts blocks from (kv_holds.py keeps
them and decides when they go). Apart from kv_holds.py so the manager can read one without importing
the policy."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class Held:
    """One kept round: its blocks and what they hold."""

    handle: str
    token_ids: list[int]  # the tokens whose K/V the blocks hold (cache keys: images as their hashes)
    block_table: list[int]
    num_hashed: int  # leading blocks published in the prefix cache
    since: float
    deadline: float
    tools: tuple[str, ...] = ()
    decided: bool = False  # a policy said hold (else kept only for the grace)
    expected_s: float = 0.0
    asked: float = 0.0  # when the caller decided (its tools started): their time runs from here


class HeldRounds(Protocol):
    """What the manager reads of the holds: the kept rounds by handle."""

    held: dict[str, Held]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
