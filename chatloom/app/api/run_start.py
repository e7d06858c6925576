"""Starting a generation for a stateless API route (OpenAI's, Anthropic's): through the shared pipeline up
to the first piece, so that a refusal (too long, over quota, busy, model not ready) is a proper HTTP error
rather than an error inside a 200 stream."""
from __future__ import annotations

from typing import AsyncIterator

from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.generation.pipeline import Ask, Choice, Piece, Pipeline, Prompt, Run


async def start_run(pipeline: Pipeline, ask: Ask, prompt: Prompt, moderate: str, session: AsyncSession,
                    by_choice: bool = False, extra_rounds: int = 0) -> tuple[Run, AsyncIterator, Piece | Choice | None]:
    """The run, its pieces (`by_choice`: as Choice objects, for an ask of several) and the first of them
    (None: the stream ended at once). On any failure the run is closed (its slot and reservation given
    back) before the exception leaves. `extra_rounds`: rounds after tool results to reserve quota for."""
    run = await reserve_run(pipeline, ask, prompt, moderate, extra_rounds)
    return await begin_run(run, prompt, session, by_choice)


async def reserve_run(pipeline: Pipeline, ask: Ask, prompt: Prompt, moderate: str, extra_rounds: int = 0) -> Run:
    """The run opened (caps, input moderation) with its quota reserved: every refusal that costs nothing
    (too long, over quota, queue full) happens here. On failure the run is closed before the exception leaves."""
    run = await pipeline.open(ask, moderate)
    try:
        await run.measure(prompt)  # tokenizing a large prompt off the event loop
        await run.reserve(prompt, extra_rounds=extra_rounds)
    except BaseException:
        await run.close()
        raise
    return run


async def begin_run(run: Run, prompt: Prompt, session: AsyncSession,
                    by_choice: bool = False) -> tuple[Run, AsyncIterator, Piece | Choice | None]:
    """A reserved run admitted and started, up to its first piece (see start_run)."""
    pieces = None
    try:
        # Authentication is done with the database: hand its connection back before a possibly long
        # wait in the queue, or a burst of waiting requests would drain the connection pool.
        await session.close()
        await run.admit(prompt)
        pieces = run.stream_choices() if by_choice else run.stream()
        first = await anext(pieces, None)
    except BaseException:
        if pieces is not None:
            await pieces.aclose()
        await run.close()
        raise
    return run, pieces, first
