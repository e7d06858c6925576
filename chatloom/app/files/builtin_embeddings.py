"""Passage and question vectors from the static embedding model run in the gateway (`files.embedding_model`).

The default embedder of file retrieval: an embedding model trained for similarity, not a chat model's
hidden states, and a table lookup rather than a forward pass, so a question costs well under a
millisecond and no engine step (chatloom/models/static_embeddings.py). It is the operator's model, not
the user's model work: no quota or admission queue applies, as for a remote embedding server. A single
question is embedded in the event loop (a fraction of a millisecond, about what a thread hop costs); a
batch of passages in a worker thread. The model loads once per process, at the gateway's start (`start`)
or on first use. When its package is missing, every call raises `BuiltinEmbeddingError`, a BackendError:
files are then indexed and messages answered with full-text search alone, and the gateway logs why.
"""
from __future__ import annotations

import asyncio
import logging

import numpy as np

from chatloom.models.config import ModelError
from chatloom.models.static_embeddings import StaticEmbedder, load_static_embedder
from chatloom.serving import BackendError, EmbedInput, Embeddings
from chatloom.store import User

log = logging.getLogger(__name__)


class BuiltinEmbeddingError(BackendError):
    """The static embedding model could not be loaded (its package is not installed), or an input has no
    word or number to embed."""


class BuiltinEmbedder:
    """The `Embedder.embed` interface over a static embedding model in this process."""

    def __init__(self, model_id: str) -> None:
        self.model = model_id
        self._loaded: StaticEmbedder | None = None

    def load(self) -> StaticEmbedder:
        """The model, loaded once; BuiltinEmbeddingError when it cannot be."""
        if self._loaded is None:
            try:
                self._loaded = load_static_embedder(self.model)
            except ModelError as exc:
                raise BuiltinEmbeddingError(str(exc)) from exc
        return self._loaded

    async def start(self) -> None:
        """Load in a worker thread at the gateway's start, so no request waits for it; a missing package
        is logged, not raised (retrieval goes on with full-text search)."""
        try:
            await asyncio.to_thread(self.load)
        except BuiltinEmbeddingError as exc:
            log.warning("file retrieval without vectors, full-text search only: %s", exc)

    async def embed(self, user: User, inputs: list[EmbedInput], model: str | None = None,
                    param: str = "input") -> tuple[str, Embeddings]:
        """The model id and one unit vector per input. `user`, `model` and `param` are the served path's:
        the configured model serves everyone."""
        if any(not isinstance(x, str) for x in inputs):
            raise BuiltinEmbeddingError(f"{self.model} embeds text, not token ids")
        embedder = self._loaded or await asyncio.to_thread(self.load)
        if len(inputs) == 1:
            ids, vectors = _embed(embedder, inputs)
        else:
            ids, vectors = await asyncio.to_thread(_embed, embedder, inputs)
        if not vectors.any(axis=1).all():  # no word or number in it: a zero vector ranks nothing
            raise BuiltinEmbeddingError(f"{self.model}: an input without a word or number to embed")
        return self.model, Embeddings(vectors.tolist(), sum(len(row) for row in ids))


def _embed(embedder: StaticEmbedder, texts: list[str]) -> tuple[list[list[int]], np.ndarray]:
    ids = embedder.encode(texts)
    return ids, embedder.pool(ids)
