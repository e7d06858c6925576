"""What a request may constrain its output to, turned into an llguidance grammar.

Kept free of tokenizers and tensors so the app can build and check one before any model work:
a schema the library cannot compile is refused when the request is made (a 400), not mid-stream.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import llguidance

Kind = Literal["json", "json_schema", "regex", "choice", "lark"]

# Any JSON object: what OpenAI's response_format {"type": "json_object"} promises.
_ANY_OBJECT: dict = {"type": "object"}
# Whitespace between JSON tokens: at most one space or newline-plus-indent, so a sampled answer
# cannot wander into an endless run of blanks (the library's default allows any amount).
_JSON_OPTIONS = {"whitespace_pattern": r"[ \n]?[ ]{0,4}"}


class ConstraintError(ValueError):
    """The constraint cannot be compiled; the message names the problem."""


@dataclass(frozen=True)
class Constraint:
    """kind: json (any JSON object), json_schema (value: the schema, a dict), regex (value: the
    pattern), choice (value: the list of allowed strings), lark (value: a Lark grammar)."""

    kind: Kind
    value: Any = None

    @classmethod
    def json_object(cls) -> "Constraint":
        return cls("json")

    @classmethod
    def json_schema(cls, schema: dict) -> "Constraint":
        return cls("json_schema", schema)

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> "Constraint":
        return cls("choice", tuple(options))

    @cached_property
    def grammar(self) -> str:
        """The llguidance grammar text; raises ConstraintError when it does not compile."""
        try:
            grammar = self._build()
        except ConstraintError:
            raise
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ConstraintError(f"cannot compile the {self.kind} constraint: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error and not error.startswith("WARNING"):
            raise ConstraintError(f"cannot compile the {self.kind} constraint: {error}")
        return grammar

    def check(self) -> None:
        """Raise ConstraintError now if the grammar does not compile."""
        self.grammar  # noqa: B018 - compiled and cached

    def _build(self) -> str:
        if self.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=_JSON_OPTIONS)
        if self.kind == "json_schema":
            if not isinstance(self.value, dict):
                raise ConstraintError("a JSON schema must be an object")
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(self.value), defaults=_JSON_OPTIONS)
        if self.kind == "regex":
            if not isinstance(self.value, str) or not self.value:
                raise ConstraintError("a regex constraint needs a non-empty pattern")
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            options = list(self.value or ())
            if not options or not all(isinstance(o, str) and o for o in options):
                raise ConstraintError("a choice constraint needs a list of non-empty strings")
            # Lark string literals, JSON-escaped (a JSON string is a valid Lark string).
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
        if self.kind == "lark":
            if not isinstance(self.value, str):
                raise ConstraintError("a lark constraint needs the grammar text")
            return llguidance.LLMatcher.grammar_from_lark(self.value)
        raise ConstraintError(f"unknown constraint kind {self.kind!r}")
