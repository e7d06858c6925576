"""Embeddings through the traffic controls every generation passes, for every caller.

`/v1/embeddings` and file retrieval (indexing passages, embedding a question) both call `embed()`:
the model must be allowed for the caller's tier, the request within the size caps; the inputs' tokens
are reserved from the quota (429 past it), the request waits its turn in the admission queue (503 after
the queue timeout), runs on the backend, and the tokens really used are settled and metered, as an
answer's prompt tokens are. Nothing here knows which front asked.
"""
from __future__ import annotations

from chatloom.app.core.errors import ApiError
from chatloom.app.core.validation import off_loop
from chatloom.app.traffic.admission import INTERACTIVE
from chatloom.app.traffic.control import Traffic
from chatloom.serving import Backend, EmbedInput, Embeddings, Usage
from chatloom.settings import Settings
from chatloom.store import User


class Embedder:
    """The embed path of the pipeline: caps, quota, admission, backend, settle, meter."""

    def __init__(self, backend: Backend, traffic: Traffic, settings: Settings) -> None:
        self.backend = backend
        self.traffic = traffic
        self.settings = settings

    async def embed(self, user: User, inputs: list[EmbedInput], model: str | None = None,
                    param: str = "input") -> tuple[str, Embeddings]:
        """The model id used and one unit vector per input; raises ApiError (4xx/5xx) or a backend error."""
        caps = self.settings.embeddings
        model_id = self.backend.resolve_model(model)
        tier = self.traffic.tier(user)
        self.traffic.check_model(tier, model_id)
        if len(inputs) > caps.max_inputs:
            raise ApiError(400, f"at most {caps.max_inputs} inputs per request; got {len(inputs)}",
                           "invalid_value", param)
        size = sum(len(x) for x in inputs if isinstance(x, str))
        per_input = await off_loop(lambda: [self.backend.embedding_tokens([x], model_id) for x in inputs], size=size)
        tokens = sum(per_input)
        window = self.backend.context_window
        longest = max(range(len(per_input)), key=per_input.__getitem__, default=0)
        if per_input and per_input[longest] > window:
            raise ApiError(400, f"input {longest} takes {per_input[longest]} tokens; this model embeds at most "
                           f"{window}", "context_length_exceeded", param)
        if tokens > caps.max_request_tokens:
            raise ApiError(400, f"the inputs take {tokens} tokens; at most {caps.max_request_tokens} per request",
                           "invalid_value", param)
        reservation = await self.traffic.reserve(user, tier, tokens)
        used = 0
        try:
            # The engine holds the KV blocks of one input at a time (embedding.py in the engine): the
            # longest input is what must fit, not all of them together.
            async with await self.traffic.admit(tier, max(per_input), INTERACTIVE) as slot:
                slot.started()
                result = await self.backend.embed(inputs, model_id)
            used = result.prompt_tokens
        finally:
            await self.traffic.quotas.settle(reservation, used)
        await self.traffic.meter.record(user.id, model_id, Usage(prompt_tokens=used))
        return model_id, result
