"""Passage and question vectors from a remote OpenAI-compatible embedding server (`files.embeddings_url`).

A dedicated embedding model (a text-embeddings server, vLLM or llama.cpp serving one, OpenAI's API) ranks
far better than a chat model's hidden states, and it need not be served beside the chat model. The
request is `{"model", "input": [texts]}` to the configured URL, with the key as a bearer token; the answer's
`data[i].embedding` (ordered by `index`) is made unit length, as the stored vectors are. It is the
operator's server, not the user's model work: no quota or admission queue applies. Anything wrong (no
answer in time, an error status, a body not of that shape) raises `EmbeddingServerError`, a BackendError:
the callers then index a file or answer a message with full-text search alone, and log why.
"""
from __future__ import annotations

import math

import httpx

from chatloom.serving import BackendError, EmbedInput, Embeddings
from chatloom.settings import Settings
from chatloom.store import User


class EmbeddingServerError(BackendError):
    """The remote embedding server did not give one vector per input."""


class RemoteEmbedder:
    """The `Embedder.embed` interface over a remote /v1/embeddings."""

    def __init__(self, url: str, model: str, api_key: str | None = None, timeout_s: float = 10.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url
        self.model = model
        self._client = httpx.AsyncClient(timeout=timeout_s, headers=headers, transport=transport)

    @classmethod
    def from_settings(cls, settings: Settings) -> "RemoteEmbedder":
        f = settings.files
        assert f.embeddings_url and f.embedding_model  # the settings' validator sees to it
        return cls(f.embeddings_url, f.embedding_model, f.embeddings_api_key, f.embeddings_timeout_s)

    async def embed(self, user: User, inputs: list[EmbedInput], model: str | None = None,
                    param: str = "input") -> tuple[str, Embeddings]:
        """The model id and one unit vector per input; EmbeddingServerError when the server fails. `user`,
        `model` and `param` are the local path's: the configured model serves everyone."""
        try:
            r = await self._client.post(self.url, json={"model": self.model, "input": inputs})
        except httpx.HTTPError as exc:
            raise EmbeddingServerError(f"embedding server {self.url}: {type(exc).__name__}: {exc}") from exc
        if r.status_code != 200:
            raise EmbeddingServerError(f"embedding server {self.url} answered {r.status_code}")
        try:
            body = r.json()
            data = sorted(body["data"], key=lambda d: d["index"])
            vectors = [_unit([float(x) for x in d["embedding"]]) for d in data]
            tokens = int((body.get("usage") or {}).get("prompt_tokens") or 0)
        except (ValueError, KeyError, TypeError) as exc:
            raise EmbeddingServerError(f"embedding server {self.url}: malformed answer ({exc})") from exc
        if len(vectors) != len(inputs) or len({len(v) for v in vectors}) > 1 or not vectors or not vectors[0]:
            raise EmbeddingServerError(f"embedding server {self.url}: {len(vectors)} vectors of uneven or no "
                                       f"width for {len(inputs)} inputs")
        return self.model, Embeddings(vectors, tokens)

    async def close(self) -> None:
        await self._client.aclose()


def _unit(v: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in v))
    if not math.isfinite(norm) or norm == 0:
        raise ValueError("a zero or non-finite vector")
    return [x / norm for x in v]
