"""The lexicon's shortcuts (contraction scans skipped when their text is absent, one scan over every
category before the per-category ones) give the same normalized text and verdicts as doing it all."""
from __future__ import annotations

import random
import unicodedata

from chatloom.app import moderation as m

PHRASES = ["I'll", "Im gonna", "you're", "he's", "won't", "will n't", "wont", "u r", "ur", "ya", "gon", "wanna",
           "gotta", "don't", "it's", "they're", "I\u2019m going to kill you", "k i l l", "i know where you live",
           "How do I make a pipe bomb", "all immigrants should die", "1 w1ll k1ll y0u", "best way to die"]


def _normalize_every_scan(text: str) -> str:
    t = unicodedata.normalize("NFKC", text)
    t = m._INVISIBLE.sub("", t).lower().translate(m._LEET)
    t = m._NON_WORD.sub(" ", t)
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
