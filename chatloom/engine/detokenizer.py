"""Turn a growing list of token ids into text deltas, never splitting a character."""
from __future__ import annotations

from chatloom.models.tokenizer import TextTokenizer


class IncrementalDetokenizer:
    """Decodes a window of recent tokens each time; a delta that ends in an incomplete
    UTF-8 sequence (shown as U+FFFD) is held back until the next token completes it."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decoding window (context for spacing)
        self.read_offset = 0  # tokens already turned into emitted text
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        full = decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is left at the end, even if it is an incomplete character."""
        rest = self.tokenizer.decode(self.ids[self.read_offset:])
        self.read_offset = len(self.ids)
        self.text += rest
        return rest
