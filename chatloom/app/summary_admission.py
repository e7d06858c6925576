"""Summaries are generations like any other: reserved against the user's quota and admitted
through the queue before they run.

A summary of older turns is model work done for the user who sent the new message. Before it
runs, the user's reservation grows by the summary's prompt plus its max_tokens (so concurrent turns
cannot overshoot the per-minute limit together), and it waits for a slot in the admission queue like
an answer does. A summary that does not fit (the quota would be exceeded, or the queue has no room
in time) is skipped: the answer is then built from the newest turns that fit, the oldest dropped.
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from chatloom.app.admission import INTERACTIVE
from chatloom.app.errors import ApiError
from chatloom.serving import GenerationRequest

log = logging.getLogger(__name__)


@asynccontextmanager
async def admitted_summary(service: Any, gen: Any, request: GenerationRequest) -> AsyncIterator[bool]:
    """Yields True once the summary request is reserved and admitted, False when it must be skipped.
    `service` is the ConversationService, `gen` its Generation (passed in: they import this module)."""
    traffic = service.traffic
    if traffic is None:  # no traffic control: nothing to reserve or queue for
        yield True
        return
    prompt = service.backend.count_prompt_tokens(request.messages)
    need = prompt + request.max_tokens
    if gen.reservation is not None and gen.tier is not None:
        try:
            traffic.extend(gen.reservation, gen.tier, gen.reservation.tokens + need)
        except ApiError as exc:
            log.info("summary of %s skipped: %s", gen.conversation_id, exc.message)
            yield False
            return
        gen.summary_reserved += need  # the answer's own top-up comes on top of this
    tier = gen.tier or traffic.tiers.for_user(None)
    try:
        slot = await traffic.admit(tier, prompt, INTERACTIVE)
    except ApiError as exc:
        log.info("summary of %s skipped: %s", gen.conversation_id, exc.message)
        yield False
        return
    try:
        yield True
    finally:
        slot.release()
