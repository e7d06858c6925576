"""The lexicon's shortcuts (ASCII text not NFKC-normalized, punctuation and spaces folded in one scan,
contraction scans skipped when their text is absent, one scan over every category before the
per-category ones, the output check's full scan started where the partial search found the first
possible phrase) give the same normalized text and verdicts as doing it all."""
from __future__ import annotations

import asyncio
import random
import re
import unicodedata

from chatloom.app.traffic import moderation as m

PHRASES = ["I\u2019ll", "k\u200bill y\u00adou", "\uff4b\uff49\uff4c\uff4c you", "caf\u00e9", "Kill\tyou\n", "how  to", "  ",
           "I'll", "Im gonna", "you're", "he's", "won't", "will n't", "wont", "u r", "ur", "ya", "gon", "wanna",
           "gotta", "don't", "it's", "they're", "I\u2019m going to kill you", "k i l l", "i know where you live",
           "How do I make a pipe bomb", "all immigrants should die", "1 w1ll k1ll y0u", "best way to die"]


def _normalize_every_scan(text: str) -> str:
    t = unicodedata.normalize("NFKC", text)
    t = m._INVISIBLE.sub("", t).lower().translate(m._LEET)
    t = re.sub(r"[^a-z0-9' ]+", " ", t)
    t = m._SPACES.sub(" ", t).strip()
    t = m._SPACED_LETTERS.sub(lambda g: g.group(0).replace(" ", ""), t)
    for pattern, replacement, *_ in m._CONTRACTIONS:
        t = pattern.sub(replacement, t)
    return m._SPACES.sub(" ", t).strip()


def _samples(n: int) -> list[str]:
    rng = random.Random(7)
    words = ("the a time him summer user your yay gone wonton i you we it is are will not can do how "
             "u'll r' 'ur ya's gon'na im'm").split()
    out = []
    for _ in range(n):
        parts = [rng.choice(words + PHRASES) for _ in range(rng.randrange(1, 30))]
        out.append(" ".join(parts) + rng.choice(["", " tonight", " soon", "'", "."]))
    return out


def test_normalize_skips_no_scan_that_would_change_the_text():
    for text in _samples(3000):
        assert m.normalize(text) == _normalize_every_scan(text), text


def test_verdicts_match_the_per_category_scans():
    mod = m.LexiconModerator()
    for text in _samples(3000):
        norm = m.normalize(text)
        expected = next((m.Verdict(c, hit.group(0)) for c, p in mod._patterns if (hit := p.search(norm))), None)
        assert mod._check(text) == expected, text


def test_output_check_agrees_with_a_full_scan_of_the_window():
    # The guard's windows: every third prefix of each sample, as an answer streams.
    mod = m.LexiconModerator()

    async def compare() -> int:
        hits = 0
        for text in _samples(400):
            for end in range(1, len(text) + 1, 3):
                window = text[:end]
                expected = mod._check(window)
                hits += expected is not None
                assert await mod.check_output(window) == expected, window
        return hits

    assert asyncio.run(compare()) > 100  # the samples do reach the phrases
