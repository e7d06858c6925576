"""Stable keys for full KV blocks, the same in every process.

A full block's key is hash(parent key, its token ids), rooted in the model id, so identical
prefixes map to identical keys. The engine's prefix cache, a replica's published cache events,
the router's prefix index and the simulator all compute keys here, so a key computed by a
router in one process names the same block a replica holds in another. Python's built-in
hash() is salted per process for strings, hence blake2b.

An image's tokens are all the same placeholder id, so a prompt's blocks are keyed with each image
token replaced by a negative id drawn from the image's content hash (`with_image_keys`): the same
image in the same place reuses its KV blocks, and another image there does not.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Sequence


def root_key(model_key: str) -> int:
    """The parent key of a sequence's first block, for the model `model_key`."""
    return _digest(b"chatloom-root\0" + model_key.encode("utf-8"))


def block_key(parent: int, tokens: Sequence[int]) -> int:
    """The key of a full block holding `tokens` after the block keyed `parent`."""
    return _digest(struct.pack(f"<Q{len(tokens)}q", parent, *tokens))


def prefix_block_keys(token_ids: Sequence[int], block_size: int, model_key: str,
                      max_blocks: int | None = None) -> list[int]:
    """Keys of every full block of `token_ids` in order (at most `max_blocks`)."""
    keys: list[int] = []
    parent = root_key(model_key)
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, max_blocks)
    for i in range(num_full):
        parent = block_key(parent, token_ids[i * block_size:(i + 1) * block_size])
        keys.append(parent)
    return keys


def image_token_key(content_hash: str) -> int:
    """The id an image's tokens stand as in block keys: negative, so never a vocabulary id."""
    return -1 - (int(content_hash[:15], 16) if content_hash else 0)


def with_image_keys(token_ids: Sequence[int], images: Sequence[tuple[str, Sequence[int]]]) -> list[int]:
    """`token_ids` with each image's positions ((content hash, positions) per image) replaced by
    that image's key."""
    out = list(token_ids)
    for content_hash, positions in images:
        key = image_token_key(content_hash)
        for p in positions:
            out[p] = key
    return out


def _digest(data: bytes) -> int:
    # 63 bits keep keys positive in a signed 64-bit column or JSON number.
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1

