"""The streamed text chunks come from a template encoded once per stream: byte for byte what encoding
each chunk whole gives."""
from __future__ import annotations

import pytest

from chatloom.app.api.routes.openai import _ChatFormat, _CompletionFormat, _TextChunks
from chatloom.app.api.sse import frame

TEXTS = ["Hello", "", ' "quoted" \\ back', "two\nlines\r\n", "caf\u00e9 \u4f60\u597d \U0001f600", "\u0000\u001f", "\ufffd"]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("fmt", [_ChatFormat(reasoning=True, logprobs=False), _CompletionFormat(False, None, 1)],
                         ids=["chat", "completion"])
def test_text_chunks_match_whole_encoding(fmt, include_usage):
    base = {"id": "chatcmpl-abc", "object": fmt.object, "created": 1700000000, "model": "m\u00e9",
            "system_fingerprint": None}

    def chunk(choice: dict, index: int = 0) -> bytes:
        data = {**base, "object": fmt.chunk_object,
                "choices": [{"index": index, "logprobs": None, "finish_reason": None, **choice}]}
        if include_usage:
            data["usage"] = None
        return frame(data)

    text_chunk = _TextChunks(chunk, fmt)
    fields = ["content", "reasoning_content"] if isinstance(fmt, _ChatFormat) else ["text"]
    for index in (0, 2):  # each choice of several has its own template
        for field in fields:
            for text in TEXTS:
                assert text_chunk(field, text, index) == chunk(fmt.text_choice(field, text), index)
