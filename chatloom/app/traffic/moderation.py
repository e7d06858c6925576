"""Moderation: a pluggable check of what users send and of what the model writes.

`Moderator` has two async checks, input and output. The default `LexiconModerator` is a fast local
classifier: per category, word and phrase patterns matched on normalized text (lower case,
contractions and slang spelled out, leetspeak undone, spaced-out letters joined, punctuation folded
to spaces). It runs offline in microseconds. `RemoteModerator` (remote_moderation.py) asks an
OpenAI-compatible /v1/moderations endpoint instead; traffic.build_moderator picks one from the settings.

`OutputGuard` checks the answer while it streams. With a moderator that can tell which trailing text
could still grow into a violation (the lexicon can: a partial match of its patterns), it holds back
exactly that text and shows the rest at once, so an ordinary answer streams without delay while a
phrase that is still being written is caught before any of it reaches the user. With other
moderators it holds back the newest few pieces.
"""
from __future__ import annotations

import abc
import functools
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import regex  # partial matching: which trailing text could still become a match

from chatloom.app.core.validation import off_loop


@dataclass(frozen=True)
class Verdict:
    category: str
    match: str  # the normalized text that matched, for logs (not shown to users)


@dataclass(frozen=True)
class Classification:
    """One text's full result, as /v1/moderations reports it: every category, flagged or not, and a score."""

    flagged: bool
    categories: dict[str, bool]
    category_scores: dict[str, float]


# OpenAI's moderation categories: /v1/moderations reports each of them (clients read them by name).
OPENAI_CATEGORIES = ("harassment", "harassment/threatening", "hate", "hate/threatening", "illicit",
                     "illicit/violent", "self-harm", "self-harm/intent", "self-harm/instructions", "sexual",
                     "sexual/minors", "violence", "violence/graphic")


def classification(flagged_categories: set[str], own: tuple[str, ...] = (),
                   same_as: dict[str, tuple[str, ...]] | None = None) -> Classification:
    """A yes/no result as a Classification: OpenAI's categories and `own` all reported, those flagged (and
    the OpenAI categories `same_as` says they imply) true with score 1.0, the rest false with 0.0."""
    hits = set(flagged_categories)
    for category in flagged_categories:
        hits.update((same_as or {}).get(category, ()))
    names = list(dict.fromkeys((*OPENAI_CATEGORIES, *own, *sorted(flagged_categories))))
    return Classification(bool(hits), {n: n in hits for n in names}, {n: float(n in hits) for n in names})


class Moderator(abc.ABC):
    # How much already-shown text the output check sees with the held-back part, so a phrase split
    # across pieces still matches.
    window_chars: int = 200
    enabled = True  # False: nothing is checked (and /v1/moderations says so rather than pass everything)
    name = "chatloom-moderation"  # the `model` /v1/moderations reports

    @abc.abstractmethod
    async def check_input(self, text: str) -> Verdict | None:
        """A verdict if the user's message must be refused."""

    @abc.abstractmethod
    async def check_output(self, text: str) -> Verdict | None:
        """A verdict if this stretch of the model's answer must not be shown."""

    async def close(self) -> None:
        """Release connections (a remote moderator's)."""

    async def classify(self, texts: list[str]) -> tuple[str, list[Classification]]:
        """Each text's full result, for /v1/moderations, and the name of the model that judged them.
        By default the input check's verdict: its one category flagged, or nothing."""
        results = []
        for text in texts:
            verdict = await self.check_input(text)
            results.append(classification({verdict.category} if verdict else set()))
        return self.name, results

    def safe_prefix(self, text: str, cuts: Sequence[int] | None = None) -> int | None:
        """How many leading characters of `text` (which check_output passed) no continuation can
        turn into a violation; None when this moderator cannot tell (the guard then holds back
        a fixed number of pieces). With `cuts` (ascending), only those lengths matter: the answer
        may be the largest safe one of them (0 when none is), which can be cheaper to find."""
        return None


class ModerationUnavailable(Exception):
    """A moderator that could not give a verdict (a remote service down): the input is refused with a 503."""


class NoModerator(Moderator):
    window_chars = 0
    enabled = False

    async def check_input(self, text: str) -> Verdict | None:
        return None

    async def check_output(self, text: str) -> Verdict | None:
        return None

    def safe_prefix(self, text: str, cuts: Sequence[int] | None = None) -> int | None:
        return len(text)


# Categories and phrases. Deliberately narrow (explicit intent or instructions), so that ordinary
# talk about history, news, medicine or fiction passes; operators extend it with their own file.
LEXICON: dict[str, list[str]] = {
    "violence/threat": [
        r"i (?:will|am going to) (?:kill|murder|stab|shoot|hurt) (?:you|him|her|them)",  # after normalize()
        r"(?:kill|murder) (?:you|your family) (?:tonight|tomorrow|soon)",
        r"you (?:will|are going to) die (?:tonight|tomorrow|soon)",
        r"i know where you live",
    ],
    "hate": [
        r"(?:all|every) (?:\w+ )?(?:people|immigrants|foreigners) (?:should|must|deserve to) (?:die|be killed|be exterminated)",
        r"(?:exterminate|gas) (?:the|all) (?:\w+)",
        r"subhuman (?:race|people|vermin)",
    ],
    "self-harm": [
        r"(?:i want to|how (?:do i|to|can i)) (?:kill myself|end my life|commit suicide)",
        r"(?:best|easiest|painless) way to (?:kill myself|die|commit suicide)",
        r"how (?:many|much) (?:pills|tablets) (?:to|would) (?:kill|overdose)",
    ],
    "sexual/minors": [
        r"(?:sex|sexual|nude|naked|explicit)\w* (?:with|of|involving|pictures of) (?:a |an )?(?:child|children|minor|minors|kid|kids|\d{1,2} ?year ?old)",
        r"(?:child|minor|underage|preteen) (?:porn|sex|nudes|erotica)",
    ],
    "weapons/instructions": [
        r"how (?:do i|to|can i) (?:make|build|assemble) (?:a |an )?(?:pipe bomb|bomb|explosive|ied|nerve agent|bioweapon|molotov)",
        r"(?:recipe|instructions|steps) (?:for|to make) (?:a |an )?(?:pipe bomb|bomb|explosive|ied|nerve agent|sarin|ricin)",
        r"(?:synthesi[sz]e|make|produce) (?:sarin|vx|ricin|anthrax|mustard gas)",
    ],
}

_LEET = str.maketrans({"0": "o", "1": "i", "3": "e", "4": "a", "5": "s", "7": "t", "@": "a", "$": "s",
                       "!": "i", "|": "i", "+": "t", "\u2019": "'", "\u2018": "'", "`": "'"})
_NON_WORD_OR_SPACE = re.compile(r"[^a-z0-9']+")
_SPACES = re.compile(r"\s+")
_INVISIBLE = re.compile("[\u00ad\u200b-\u200f\u2060\ufeff]")  # soft hyphen, zero-width characters
# Letters written apart ("k i l l", "k.i.l.l"): three or more single letters in a row are one word.
_SPACED_LETTERS = re.compile(r"\b(?:[a-z] ){2,}[a-z]\b")
# Contractions and spoken forms, spelled out so one pattern covers "I'm going to", "Im gonna", "I'll".
# Each comes with the substrings one of which any match contains: the output guard normalizes its
# window on every token, and a cheap `in` test skips most of these scans over ordinary text. A pattern
# that is one whole word (\bu\b) is looked up among the text's words instead, as its letters are in
# nearly every text ("u" in "you").
_CONTRACTIONS = [(re.compile(p), r, needles, m.group(1) if (m := re.fullmatch(r"\\b(\w+)\\b", p)) else None)
                 for p, r, needles in [
    (r"\b(i|you|we|they|he|she) ?'ll\b", r"\1 will", ("'ll",)), (r"\b(i) ?'m\b", r"\1 am", ("'m",)),
    (r"\bim\b", "i am", ("im",)),
    (r"\b(you|we|they) ?'re\b", r"\1 are", ("'re",)), (r"\b(he|she|it) ?'s\b", r"\1 is", ("'s",)),
    (r"\bgonna\b", "going to", ("gonna",)), (r"\bwanna\b", "want to", ("wanna",)),
    (r"\bgotta\b", "got to", ("gotta",)),
    (r"\bu\b", "you", ("u",)), (r"\br\b", "are", ("r",)), (r"\bur\b", "your", ("ur",)),
    (r"\bya\b", "you", ("ya",)), (r"\bgon\b", "going to", ("gon",)),
    (r"\bwill ?n't\b|\bwont\b", "will not", ("n't", "wont")), (r"\bn't\b", " not", ("n't",)), (r"'", "", ("'",)),
]]
# The words \b sees once punctuation is folded: the text is then [a-z0-9' ] only.
_WORDS = re.compile(r"[ ']+")


# Cached: the guard checks a window and then asks where it may cut the same window, and the cut
# points it tries are prefixes it asked about one piece earlier.
@functools.lru_cache(maxsize=64)
def normalize(text: str) -> str:
    """Lower case, leetspeak to letters, punctuation to spaces, spaced-out letters joined, contractions and
    slang spelled out ("Im gonna" -> "i am going to"), single spaces."""
    if text.isascii():  # NFKC leaves ASCII as it is, and the invisible characters are not ASCII
        t = text.lower().translate(_LEET)
    else:
        t = unicodedata.normalize("NFKC", text)
        t = _INVISIBLE.sub("", t).lower().translate(_LEET)
    # Every run of anything but [a-z0-9'] (spaces included) is one space: punctuation folded and
    # spaces collapsed in one scan.
    t = _NON_WORD_OR_SPACE.sub(" ", t).strip()
    t = _SPACED_LETTERS.sub(lambda m: m.group(0).replace(" ", ""), t)
    words: set[str] | None = None  # of t as it is now
    spelled_out = False
    for pattern, replacement, needles, word in _CONTRACTIONS:
        if word is not None:
            if words is None:
                words = set(_WORDS.split(t))
            if word not in words:
                continue
        elif not any(needle in t for needle in needles):
            continue
        changed = pattern.sub(replacement, t)
        if changed != t:
            t, words, spelled_out = changed, None, True
    # Joining spaced letters leaves single spaces; only a spelled-out form can add a space at an end
    # or next to another.
    return _SPACES.sub(" ", t).strip() if spelled_out else t


# The OpenAI categories each of the built-in lexicon's categories falls under.
LEXICON_AS_OPENAI: dict[str, tuple[str, ...]] = {
    "violence/threat": ("violence", "harassment/threatening"),
    "hate": ("hate", "hate/threatening"),
    "self-harm": ("self-harm", "self-harm/intent"),
    "sexual/minors": ("sexual", "sexual/minors"),
    "weapons/instructions": ("illicit", "illicit/violent"),
}


class LexiconModerator(Moderator):
    name = "chatloom-lexicon"

    def __init__(self, lexicon: dict[str, list[str]] | None = None, window_chars: int = 200) -> None:
        self.lexicon = LEXICON if lexicon is None else lexicon
        # One alternation per category, whole words only; the category order decides ties.
        self._patterns = [(cat, re.compile(r"\b(?:" + "|".join(f"(?:{p})" for p in phrases) + r")\b"))
                          for cat, phrases in self.lexicon.items() if phrases]
        # Every category at once: one scan tells whether any matches (nearly always not), so the
        # per-category scans that name the verdict run only on a hit.
        every = [p for phrases in self.lexicon.values() for p in phrases]
        self._any_full = re.compile(r"\b(?:" + "|".join(f"(?:{p})" for p in every) + r")\b") if every else None
        # All categories in one pattern for the partial-match search (a phrase's start, still open).
        self._any = regex.compile(r"\b(?:" + "|".join(f"(?:{p})" for phrases in self.lexicon.values()
                                                      for p in phrases) + r")\b") if self._patterns else None
        self.window_chars = window_chars
        # The last text an output guard had normalized and its normal form: at every token the guard
        # checks its window, then asks safe_prefix about the same text (and often its last cut, the
        # whole of it), so one normalization serves all three. The event loop's main cost per token.
        self._last_normal: tuple[str, str] = ("", "")
        # The last normalized text's partial-match search: it also tells the full check where to look.
        self._last_scan: tuple[str, object] = ("", None)

    def _normal(self, text: str) -> str:
        last = self._last_normal  # one read: the tuple is replaced whole, never changed in place
        if last[0] == text:
            return last[1]
        norm = normalize(text)
        self._last_normal = (text, norm)
        return norm

    def _scan(self, norm: str):
        """The leftmost match of any phrase in `norm`, full or partial (one that runs to the end and
        could still grow into a phrase); None when there is neither."""
        last = self._last_scan
        if last[0] == norm:
            return last[1]
        found = self._any.search(norm, partial=True)
        self._last_scan = (norm, found)
        return found

    def _has_full_match(self, norm: str) -> bool:
        if self._any is None or self._any_full is None:
            return False
        # The partial search finds the leftmost place any phrase matches or may still match, so a full
        # match, if there is one, starts there or later: the full scan need not look at the text before
        # it (usually all but its last word).
        first = self._scan(norm)
        if first is None:
            return False
        if not first.partial:
            return True
        return self._any_full.search(norm, first.start()) is not None

    def _check(self, text: str, norm: str | None = None) -> Verdict | None:
        norm = normalize(text) if norm is None else norm
        if self._any_full is None or self._any_full.search(norm) is None:
            return None
        return self._category_of(norm)

    def _category_of(self, norm: str) -> Verdict | None:
        for category, pattern in self._patterns:
            m = pattern.search(norm)
            if m:
                return Verdict(category, m.group(0))
        return None

    async def check_input(self, text: str) -> Verdict | None:
        return await off_loop(self._check, text, size=len(text))  # a huge message not on the event loop

    def _classify(self, text: str) -> Classification:
        """Every category whose phrases occur (the input check stops at the first)."""
        norm = normalize(text)
        hits = set()
        if self._any_full is not None and self._any_full.search(norm) is not None:
            hits = {category for category, pattern in self._patterns if pattern.search(norm)}
        return classification(hits, tuple(self.lexicon), LEXICON_AS_OPENAI)

    async def classify(self, texts: list[str]) -> tuple[str, list[Classification]]:
        return self.name, [await off_loop(self._classify, text, size=len(text)) for text in texts]

    async def check_output(self, text: str) -> Verdict | None:
        norm = self._normal(text)
        return self._category_of(norm) if self._has_full_match(norm) else None

    def safe_prefix(self, text: str, cuts: Sequence[int] | None = None) -> int:
        """The text before the earliest place where a phrase could be starting (a partial match
        running to the end of the normalized text); all of it when there is none. With `cuts`,
        the largest of them that ends before that place (0 when none does)."""
        if self._any is None:
            return len(text)
        norm = self._normal(text)
        m = self._scan(norm)
        if m is None:
            return len(text)
        start = m.start()
        if cuts is not None:
            # The guard releases whole pieces, so only the few piece boundaries matter: try them from
            # the last, usually one normalization, instead of a binary search over every length.
            for cut in reversed(cuts):
                prefix = norm if cut >= len(text) else normalize(text[:cut])
                if cut <= len(text) and len(prefix) <= start and norm.startswith(prefix):
                    return cut
            return 0
        # The longest raw prefix whose normalized form ends before the open phrase. The normalized
        # length of a prefix almost never shrinks as the prefix grows, so a binary search finds it;
        # where slang spelled out at the cut makes the prefix read differently from the whole text
        # ("u" -> "you" but "un" stays), step back until the prefix agrees with the whole.
        lo, hi = 0, len(text)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(normalize(text[:mid])) <= start:
                lo = mid
            else:
                hi = mid - 1
        while lo > 0 and not norm.startswith(normalize(text[:lo])):
            lo -= 1
        return lo


class OutputGuard:
    """Streams an answer through output moderation with a small hold-back.

    push(text) returns the pieces now safe to show; finish() the rest. After a violation both
    return nothing more and `verdict` says why. A moderator that cannot answer blocks the rest
    (verdict category 'moderation_unavailable'): unchecked text is never shown. The check looks at a sliding window: the held-back
    text plus the last `window_chars` characters already shown, so phrases split across pieces match.
    Where the moderator can tell (safe_prefix), only pieces that could be the start of a phrase are
    held, so none of a phrase is ever shown; otherwise the newest `holdback_tokens` pieces are held,
    and a phrase caught when its last piece arrives never shows its last `holdback_tokens` pieces.
    """

    def __init__(self, moderator: Moderator, holdback_tokens: int = 8) -> None:
        self.moderator = moderator
        self.holdback_tokens = holdback_tokens
        self.context_chars = moderator.window_chars
        self._held: list[str] = []
        self._held_chars = 0
        self._shown_tail = ""
        self.verdict: Verdict | None = None

    @property
    def active(self) -> bool:
        return not isinstance(self.moderator, NoModerator)

    async def _violates(self) -> bool:
        window = self._shown_tail + "".join(self._held)
        try:
            self.verdict = await self.moderator.check_output(window)
        except ModerationUnavailable as exc:
            self.verdict = Verdict("moderation_unavailable", str(exc))
        return self.verdict is not None

    async def push(self, text: str) -> list[str]:
        if self.verdict is not None:
            return []
        if not self.active:
            return [text] if text else []
        if text:
            self._held.append(text)
            self._held_chars += len(text)
        if await self._violates():
            self._held.clear()
            return []
        out: list[str] = []
        cuts, at = [], len(self._shown_tail)
        for piece in self._held:
            at += len(piece)
            cuts.append(at)
        safe = self.moderator.safe_prefix(self._shown_tail + "".join(self._held), cuts)
        if safe is not None:
            releasable = safe - len(self._shown_tail)  # characters of the held text
            while self._held and len(self._held[0]) <= releasable:
                piece = self._held.pop(0)
                releasable -= len(piece)
                self._held_chars -= len(piece)
                out.append(piece)
        while safe is None and len(self._held) > self.holdback_tokens:
            piece = self._held.pop(0)
            self._held_chars -= len(piece)
            out.append(piece)
        if out:
            self._shown_tail = (self._shown_tail + "".join(out))[-max(self.context_chars, 1):]
        return out

    async def finish(self) -> list[str]:
        """The answer ended: check once more and release what is held."""
        if self.verdict is not None or not self.active:
            return []
        if await self._violates():
            self._held.clear()
            return []
        out, self._held, self._held_chars = self._held, [], 0
        return out
