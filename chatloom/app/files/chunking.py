"""A document's text cut into overlapping passages, the units retrieval indexes and cites.

Each passage is about `size` characters and repeats the last `overlap` characters of the one before, so
a sentence cut at a boundary is whole in one of the two. Cuts fall at the best break near the end of
the window: a blank line, then a line end, then a sentence end, then a space.
"""
from __future__ import annotations

_BREAKS = ("\n\n", "\n", ". ", "? ", "! ", "; ", " ")


def _cut(text: str, start: int, end: int) -> int:
    """Where to end a passage that may end at `end` at the latest: the best break in its last third."""
    if end >= len(text):
        return len(text)
    floor = start + (end - start) * 2 // 3
    for brk in _BREAKS:
        at = text.rfind(brk, floor, end)
        if at != -1:
            return at + len(brk)
    return end


def chunk_spans(text: str, size: int, overlap: int) -> list[tuple[int, int]]:
    """(start, end) of each passage of `text`, in order; whitespace-only passages are left out."""
    overlap = min(overlap, size // 2)
    spans: list[tuple[int, int]] = []
    start = 0
    while start < len(text):
        end = _cut(text, start, start + size)
        if text[start:end].strip():
            spans.append((start, end))
        if end >= len(text):
            break
        nxt = max(end - overlap, start + 1)
        # Begin the next passage at a word, not inside one.
        space = text.find(" ", nxt, end)
        start = space + 1 if space != -1 and end - space > overlap // 2 else nxt
    return spans
