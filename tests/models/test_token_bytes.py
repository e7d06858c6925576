"""Each token's bytes (the `bytes` of logprob answers): concatenated, they spell the text exactly, even
where a token holds only part of a character."""
from __future__ import annotations

from chatloom.models.token_bytes import TokenBytes


def test_byte_level_tokens_spell_the_text(smollm2):
    tokenizer = smollm2.tokenizer
    text = "Hello wörld, ünïcode 日本語 ok\n\ttabs"
    ids = tokenizer.encode(text, add_special=False)
    as_bytes = TokenBytes(tokenizer)
    pieces = [as_bytes(i) for i in ids]
    assert b"".join(pieces).decode() == text
    assert any(len(p) == 1 and p[0] >= 0x80 for p in pieces)  # a token holding part of a character
    assert as_bytes.text(ids[0]) == "Hello"


def test_special_tokens_are_their_own_text(smollm2):
    tokenizer = smollm2.tokenizer
    eos = tokenizer.eos_token_ids[0]
    assert TokenBytes(tokenizer)(eos) == tokenizer.tokenizer.id_to_token(eos).encode()
