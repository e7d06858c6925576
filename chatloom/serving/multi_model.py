"""Several models behind one Backend: each request goes to the backend serving its model.

Why: the product offers a model picker; each model may run in this process (LocalBackend) or on a
fleet of replicas (Router). The app sees one backend whose model_ids list them all; an unknown model
is the usual UnknownModel (404 model_not_found).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import AsyncIterator

from chatloom.serving.backend import (Backend, BackendError, BackendNotReady, BackendStats, Delta, EmbedInput,
                                      Embeddings, GenerationRequest, ModelLoadFailed)

log = logging.getLogger(__name__)


class MultiModelBackend(Backend):
    """`backends` maps model id to its backend; the first is the default model."""

    def __init__(self, backends: dict[str, Backend]) -> None:
        if not backends:
            raise ValueError("no models configured")
        self.backends = dict(backends)
        self._errors: dict[str, str] = {}
        self._owner: dict[str, Backend] = {}  # request id -> the backend running it

    def check(self) -> None:
        for backend in self.backends.values():
            backend.check()

    async def start(self) -> None:
        lasting: list[bool] = []  # per failed model: whether retrying cannot help (an in-process load)

        async def one(model: str, backend: Backend) -> None:
            try:
                await backend.start()
            except BackendError as exc:
                self._errors[model] = str(exc)
                lasting.append(isinstance(exc, ModelLoadFailed))
                log.error("model %s cannot serve: %s", model, exc)

        await asyncio.gather(*(one(m, b) for m, b in self.backends.items()))
        if len(self._errors) == len(self.backends):
            error = ModelLoadFailed if all(lasting) else BackendNotReady
            raise error("; ".join(f"{m}: {e}" for m, e in self._errors.items()))

    async def close(self) -> None:
        await asyncio.gather(*(b.close() for b in self.backends.values()), return_exceptions=True)

    @property
    def ready(self) -> bool:
        return any(b.ready for b in self.backends.values())

    @property
    def load_error(self) -> str | None:
        return "; ".join(f"{m}: {e}" for m, e in self._errors.items()) or None

    @property
    def model_ids(self) -> list[str]:
        return list(self.backends)

    def backend_for(self, model: str | None) -> Backend:
        return self.backends[self.resolve_model(model)]

    @property
    def default(self) -> Backend:
        return next(iter(self.backends.values()))

    # Token counts and the window take no model argument in the Backend API: the default model's.
    @property
    def context_window(self) -> int:
        return self.default.context_window

    @property
    def tokenizer(self):
        return self.default.tokenizer

    def count_tokens(self, text: str) -> int:
        return self.default.count_tokens(text)

    def count_prompt_tokens(self, messages: list[dict]) -> int:
        return self.default.count_prompt_tokens(messages)

    def takes_images(self, model: str | None = None) -> bool:
        return self.backend_for(model).takes_images()

    async def stream(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        backend = self.backend_for(request.model)
        if not backend.ready:
            model = self.resolve_model(request.model)
            raise BackendNotReady(self._errors.get(model) or f"model {model!r} is loading")
        if request.request_id:
            self._owner[request.request_id] = backend
        try:
            # The chosen backend's own default: its id for the model may differ from the setting's.
            async for delta in backend.stream(dataclasses.replace(request, model=None)):
                yield delta
        finally:
            if request.request_id:
                self._owner.pop(request.request_id, None)

    def _ready_backend(self, model: str | None) -> Backend:
        backend = self.backend_for(model)
        if not backend.ready:
            name = self.resolve_model(model)
            raise BackendNotReady(self._errors.get(name) or f"model {name!r} is loading")
        return backend

    def embedding_tokens(self, inputs: list[EmbedInput], model: str | None = None) -> int:
        return self.backend_for(model).embedding_tokens(inputs)

    def embedding_size(self, model: str | None = None) -> int | None:
        return self.backend_for(model).embedding_size()

    async def embed(self, inputs: list[EmbedInput], model: str | None = None) -> Embeddings:
        return await self._ready_backend(model).embed(inputs, None)

    def abort(self, request_id: str) -> None:
        backend = self._owner.get(request_id)
        for b in [backend] if backend is not None else self.backends.values():
            b.abort(request_id)

    def hold_background(self, held: bool) -> None:
        for backend in self.backends.values():
            backend.hold_background(held)

    def has_room(self, prompt_tokens: int) -> bool:
        return self.default.has_room(prompt_tokens)

    def stats(self) -> BackendStats:
        per_model = {m: b.stats() for m, b in self.backends.items()}
        return dataclasses.replace(per_model[next(iter(per_model))], models=per_model)
