"""The bytes each token id stands for, as log probability answers show them (OpenAI's `bytes` field).

Decoding one token alone is not enough: a token that holds part of a multi-byte character decodes to
U+FFFD. The bytes come from the token's piece instead: byte-level BPE pieces (GPT-2, Llama 3, SmolLM)
map each character back to one byte; SentencePiece pieces spell a space as "▁" and a raw byte as
"<0xHH>". Special tokens are their own text.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache

from chatloom.models.tokenizer import TextTokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte, reversed: character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenBytes:
    """token id -> bytes for one tokenizer, each id worked out once."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = json.dumps(json.loads(tokenizer.tokenizer.to_str()).get("decoder") or {})
        self.byte_level = '"ByteLevel"' in decoder
        self.sentencepiece = '"ByteFallback"' in decoder or "\u2581" in decoder
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._bytes(token_id)
        return found

    def text(self, token_id: int) -> str:
        """The token as text (U+FFFD where it holds part of a character)."""
        return self(token_id).decode("utf-8", errors="replace")

    def _bytes(self, token_id: int) -> bytes:
        tok = self.tokenizer
        piece = tok.tokenizer.id_to_token(token_id)
        if piece is None:  # an id past the tokenizer's vocabulary (random test models)
            return b""
        if token_id in tok.special_ids:
            return piece.encode()
        if self.byte_level:
            table = _byte_level_table()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode()
        if self.sentencepiece:
            if (m := _BYTE_PIECE.fullmatch(piece)) is not None:
                return bytes([int(m.group(1), 16)])
            return piece.replace("\u2581", " ").encode()
        return tok.decode([token_id], skip_special=False).encode()
