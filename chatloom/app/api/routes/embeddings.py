"""/v1/embeddings in OpenAI's shape: a format adapter over the pipeline's embed path.

`input` is a string, a list of strings, a list of token ids or a list of token-id lists; `dimensions`
keeps the first that many components and normalizes them again (what OpenAI's text-embedding-3 models
do); `encoding_format` "base64" sends each vector as little-endian float32 bytes in base64.
"""
from __future__ import annotations

import base64
import math
import struct
from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from chatloom.app.api.deps import Ctx, CurrentUser
from chatloom.app.api.openapi_responses import SIGNED_IN, errors
from chatloom.app.core.errors import ApiError
from chatloom.serving.openai_protocol import embedding_inputs

router = APIRouter(prefix="/v1", tags=["openai"])


class EmbeddingsIn(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we do not use (user)

    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="Text or token ids to embed: one, or a list of them.")
    model: str | None = Field(None, description="Model id (default: the service's default model).")
    dimensions: int | None = Field(None, ge=1, description="Keep this many leading components, renormalized.")
    encoding_format: Literal["float", "base64"] = Field("float", description="float lists, or base64 of "
                                                                            "little-endian float32.")
    user: str | None = None


class EmbeddingOut(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsOut(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[EmbeddingOut]
    usage: EmbeddingUsage


def shape(vector: list[float], dimensions: int | None) -> list[float]:
    """The first `dimensions` components, L2-normalized again (the whole vector when None)."""
    if dimensions is None:
        return vector
    head = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def _check_dimensions(dimensions: int | None, width: int | None, model: str | None) -> None:
    if dimensions is not None and width is not None and dimensions > width:
        raise ApiError(400, f"dimensions may be at most {width}, the size of model {model or 'default'}'s "
                       "embeddings", "invalid_value", "dimensions")


@router.post("/embeddings", response_model=EmbeddingsOut, responses={**SIGNED_IN, **errors(400, 404, 429, 503)})
async def create_embeddings(body: EmbeddingsIn, user: CurrentUser, ctx: Ctx) -> EmbeddingsOut:
    """Each input's embedding: the model's final hidden states pooled (mean or last token, per model) and
    L2-normalized; through the tier's model list, the quota, the admission queue and metering."""
    inputs = embedding_inputs(body.input)
    _check_dimensions(body.dimensions, ctx.backend.embedding_size(body.model), body.model)
    model, result = await ctx.pipeline.embeddings.embed(user, inputs, body.model)
    _check_dimensions(body.dimensions, len(result.vectors[0]), model)  # a remote model's size is known only now
    data = [EmbeddingOut(index=i, embedding=encode(shape(v, body.dimensions), body.encoding_format))
            for i, v in enumerate(result.vectors)]
    return EmbeddingsOut(model=model, data=data,
                         usage=EmbeddingUsage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens))
