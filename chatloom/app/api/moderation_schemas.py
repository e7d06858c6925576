"""/v1/moderations' request and response, in OpenAI's shapes."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from chatloom.app.core.errors import ApiError

MAX_INPUTS = 256  # texts in one request


class InputPart(BaseModel):
    """A part of a multi-modal input: only text parts are read."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ModerationIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input: str | list[str] | list[InputPart]
    model: str | None = None  # the configured moderator decides; a requested name is not checked

    def texts(self) -> list[str]:
        """The texts to classify, one result each (a list of parts is one input, its texts joined)."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if not value:
            raise ApiError(400, "input must not be empty", "invalid_value", "input")
        if len(value) > MAX_INPUTS:
            raise ApiError(400, f"input has {len(value)} items; at most {MAX_INPUTS} are accepted",
                           "invalid_value", "input")
        if isinstance(value[0], str):
            return list(value)  # type: ignore[arg-type]
        texts = []
        for i, part in enumerate(value):
            if part.type != "text" or part.text is None:  # type: ignore[union-attr]
                raise ApiError(400, f"input[{i}] is of type {part.type!r}; only text can be moderated here",  # type: ignore[union-attr]
                               "unsupported_content", "input")
            texts.append(part.text)  # type: ignore[union-attr]
        return ["\n".join(texts)]


class ModerationResultOut(BaseModel):
    flagged: bool
    categories: dict[str, bool]
    category_scores: dict[str, float]


class ModerationOut(BaseModel):
    id: str
    model: str
    results: list[ModerationResultOut] = Field(description="one per input text, in order")
