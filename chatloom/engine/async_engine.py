"""asyncio face of the engine: a background thread runs the steps, coroutines stream deltas.

The step loop runs in its own thread (PyTorch and chatloom's kernels release the GIL
inside their native code), so the event loop stays responsive. Requests and aborts from
the event loop are queued and applied between steps, and the thread sleeps on an event
when idle, so a new request starts at once, never after a poll interval. A step's outputs
travel back in one call_soon_threadsafe per event loop, when the next step's forward starts
(or at once, when no step follows).

Why not as soon as the step ends: the event loop then wakes while this thread still runs the
next step's Python, and takes the GIL at the first operation that lets it go (torch.tensor
does), holding this thread up for all of its per-token work (0.3-0.5 ms a token, measured in
`chatloom serve`). Woken as the forward releases the GIL for milliseconds, it runs alongside.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from typing import AsyncIterator

from chatloom.engine.config import EngineConfig
from chatloom.engine.llm_engine import LLMEngine
from chatloom.engine.outputs import RequestOutput
from chatloom.engine.sampling_params import InvalidRequest, SamplingParams
from chatloom.engine.stats import EngineSnapshot
from chatloom.engine.thread_pool import release_thread_pool
from chatloom.models.loader import LoadedModel
from chatloom.models.vision.prompt import ImageInput

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class RequestFailedError(EngineDeadError):
    """This request (and only this one) failed inside the engine; the message says why.
    (An EngineDeadError for callers that only tell 'the engine failed me' from a good answer.)"""


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stopped = False
        self._pending: list[tuple[str, RequestOutput | BaseException]] = []  # the last step's, not yet handed over
        runner = getattr(engine, "runner", None)  # engines without a model runner hand over at once
        self._defer = runner is not None
        if self._defer:
            runner.before_forward = self._hand_over
        self._thread = threading.Thread(target=self._loop, name="chatloom-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, loaded: LoadedModel, config: EngineConfig | None = None) -> "AsyncEngine":
        return cls(LLMEngine(loaded, config))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # -- the background loop ------------------------------------------------------
    def _apply_commands(self) -> None:
        while True:
            try:
                cmd, args = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd == "add":
                request_id, prompt, params, priority, images, asked_at = args
                try:
                    self.engine.add_request(prompt, params, request_id, priority, images, asked_at)
                except Exception as exc:  # invalid request: report it on its stream
                    self._deliver(request_id, exc)
            elif cmd == "abort":
                # Frees the blocks now; the final 'abort' output comes out of the next step().
                self.engine.abort(args)
            elif cmd == "hold_kv":
                try:
                    self.engine.hold_kv(*args)
                except ValueError as exc:  # an unknown policy: the caller's mistake, the blocks go
                    log.warning("KV hold refused: %s", exc)
                    self.engine.release_kv(args[0])
            elif cmd == "release_kv":
                self.engine.release_kv(args)
            elif cmd == "hold_background":
                self.engine.hold_background(args)
            elif cmd == "reset_prefix_cache":
                self.engine.kv_cache_manager.reset_prefix_cache()
            elif cmd == "embed":
                job_id, prompts, pooling = args
                try:
                    self.engine.embedder.add(prompts, pooling, job_id)
                except Exception as exc:  # invalid input: report it to the caller
                    self._deliver(job_id, exc)
            elif cmd == "abort_embed":
                self.engine.embedder.abort(args)

    def _embed_step(self) -> None:
        """One embedding forward pass, between generation steps; finished jobs go to their callers."""
        try:
            done = self.engine.embedder.step()
        except Exception as exc:
            log.exception("embedding pass failed")
            for job in list(self.engine.embedder.jobs):
                self.engine.embedder.abort(job.job_id)
                self._deliver(job.job_id, RequestFailedError(f"embedding failed: {exc!r}"))
            return
        self._deliver_all([(job.job_id, job) for job in done])

    def _embedding(self) -> bool:
        embedder = getattr(self.engine, "embedder", None)
        return embedder is not None and embedder.has_work()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand items to their streams: one wake-up of each event loop involved, not one per item."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the loop is closed; nobody is listening
                pass

    def _hand_over(self) -> None:
        """Deliver the pending outputs (the runner calls this just before a forward releases the GIL)."""
        if self._pending:
            items, self._pending = self._pending, []
            self._deliver_all(items)

    def _loop(self) -> None:
        busy = False
        while not self._stopped:
            # Before the commands: a foreground request added after this point stops the step below.
            self.engine.clear_background_interrupt()
            self._apply_commands()
            if self._embedding():
                self._embed_step()
                if not self.engine.has_unfinished_requests():
                    continue
            if not self.engine.has_unfinished_requests() or self.engine.only_held_work():
                self._hand_over()
                holds = getattr(self.engine, "kv_holds", None)
                if holds is not None:  # a hold's timeout passes while nothing runs too
                    holds.expire()
                if busy:  # going idle: other threads' torch work must not find this pool (thread_pool.py)
                    release_thread_pool()
                    busy = False
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            busy = True
            try:
                outputs = self.engine.step()  # its forward hands the previous step's outputs over
            except Exception as exc:  # not attributable to any one request (the engine isolates those)
                log.exception("engine step failed")
                self._hand_over()
                self._fail_all(exc)
                continue
            self._hand_over()  # this step ran no forward: the previous outputs must not wait for one
            self._pending = [(out.request_id, RequestFailedError(f"generation failed: {out.error}")
                              if out.finish_reason == "error" else out) for out in outputs]
            if not self._defer or not self.engine.has_unfinished_requests():
                self._hand_over()

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            self._deliver(request_id, EngineDeadError(f"generation failed: {exc!r}"))
        self.engine.step()  # drain the abort outputs; nobody is waiting for them now

    # -- public API -----------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    priority: int = 0, images: list[ImageInput] | None = None) -> tuple[str, asyncio.Queue]:
        request_id = request_id or f"async-{next(self._ids)}"
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        # Stamped now, not when the engine thread gets to it: a resume's tools are timed from the caller.
        asked_at = self.engine.kv_holds.clock()
        self._commands.put(("add", (request_id, prompt, params, priority, images, asked_at)))
        floor = self.engine.config.background_priority
        if floor is not None and priority < floor:
            # Foreground work is here: a step of background work alone that is running stops at its next
            # layer boundary (LLMEngine.interrupt_background), and the next step is this request's. Not at
            # admission: the step runs on while the gateway gets the request here, and what it finishes
            # in that time is not thrown away.
            self.engine.interrupt_background()
        self._wakeup.set()
        return request_id, q

    def abort(self, request_id: str) -> None:
        """Free the request's blocks at the next step boundary."""
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    async def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None, priority: int = 0,
                     images: list[ImageInput] | None = None) -> AsyncIterator[RequestOutput]:
        """Yield outputs as tokens arrive, until each of the request's n choices has had its output
        with finished=True (outputs of several choices interleave; `index` tells them apart).
        Cancelling the consumer (or closing the generator) aborts the request."""
        params = params or SamplingParams()
        request_id, q = self.add_request(prompt, params, request_id, priority, images)
        finished = False
        left = params.n
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                left -= item.finished
                finished = left == 0
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       priority: int = 0) -> RequestOutput:
        last = None
        async for out in self.stream(prompt, params, priority=priority):
            last = out
        assert last is not None
        return last

    async def embed(self, prompts: list[list[int]], pooling: str = "last") -> list[list[float]]:
        """Each prompt's pooled, normalized hidden state, computed between generation steps.
        Cancelling the caller drops the job and frees its blocks."""
        job_id = f"embed-{next(self._ids)}"
        q: asyncio.Queue = asyncio.Queue()
        self._streams[job_id] = (asyncio.get_running_loop(), q)
        self._commands.put(("embed", (job_id, prompts, pooling)))
        self._wakeup.set()
        finished = False
        try:
            item = await q.get()
            finished = True
            if isinstance(item, BaseException):
                raise item
            return [list(v) for v in item.vectors]
        finally:
            self._streams.pop(job_id, None)
            if not finished:
                self._commands.put(("abort_embed", job_id))
                self._wakeup.set()

    def hold_kv(self, request_id: str, tools: list[str], policy: str, timeout_s: float) -> None:
        """The finished round `request_id` ended in tool calls: hold or evict its kept blocks (at the next
        step boundary; see LLMEngine.hold_kv)."""
        asked_at = self.engine.kv_holds.clock()
        self._commands.put(("hold_kv", (request_id, list(tools), policy, timeout_s, asked_at)))
        self._wakeup.set()

    def release_kv(self, request_id: str) -> None:
        """Free the blocks kept for the round `request_id` at the next step boundary."""
        self._commands.put(("release_kv", request_id))
        self._wakeup.set()

    def hold_background(self, held: bool) -> None:
        """Hold background (batch) sequences out of every step from the next step boundary on, or let them
        run again (see LLMEngine.hold_background). The gateway holds them from the moment a foreground
        request is admitted until its first output."""
        self._commands.put(("hold_background", held))
        self._wakeup.set()

    def reset_prefix_cache(self) -> None:
        """Forget cached blocks no running sequence holds (between benchmark runs), at the next step boundary."""
        self._commands.put(("reset_prefix_cache", None))
        self._wakeup.set()

    def get_stats(self) -> dict:
        return self.engine.get_stats()

    def snapshot(self) -> EngineSnapshot:
        return self.engine.snapshot()

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=5)
