"""The router: one Backend over many replicas of one model, placing each request with a policy.

Why it is itself a Backend: the app neither knows nor cares whether one engine or a fleet answers.
What it adds over a load balancer:
- placement by KV cache: each replica's prefix cache is tracked (exactly from its event feed, or
  approximately from what the router sent there) and a policy (policies.py) weighs hits against load
  (/metrics gauges under vLLM's names, plus the router's own count of requests in flight);
- health: a replica that stops answering /health, or fails a request, is ejected with a log line and
  taken back when it answers again (and still serves the right model); a draining replica gets no
  new work while its answers finish;
- failover: a replica that fails before the first token is replaced by another; one that dies
  mid-answer is replaced by continuation (continuation.py): the prompt plus the tokens produced so far
  become the new prompt, with what is left of the token budget, and the user's stream goes on with no
  gap and no repeated text.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Sequence

from chatloom.engine.block_hash import prefix_block_keys
from chatloom.serving.backend import (Backend, BackendError, BackendNotReady, BackendStats, BadGenerationRequest,
                                      Delta, EmbedInput, Embeddings, GenerationRequest, ReplicaStatus, Timings)
from chatloom.serving.continuation import AnswerProgress
from chatloom.serving.opening_gate import OpeningGate
from chatloom.serving.policies import make_policy
from chatloom.serving.prefix_index import PrefixIndex
from chatloom.serving.remote import (RemoteBackend, ReplicaError, ReplicaModelMismatch, ReplicaTimeout, Timeouts,
                                     count_chat_tokens, count_text_tokens, encode_chat, sampling_params)
from chatloom.serving.routing import NoReplicaAvailable, PolicyWeights, ReplicaState, RouteRequest, TtftEstimate

log = logging.getLogger(__name__)
# Kept tool rounds the router remembers the replica of (the oldest forgotten first).
MAX_KEPT = 4096


@dataclass
class RouterConfig:
    policy: str = "prefix_aware"
    weights: PolicyWeights = field(default_factory=PolicyWeights)
    health_interval: float = 1.0  # seconds between health checks (and load scrapes)
    eject_after: int = 2  # consecutive failed health checks that eject a replica
    recover_after: int = 2  # consecutive good ones that take it back
    max_attempts: int = 4  # replicas one request may try (first try included)
    follow_feeds: bool = True  # follow replicas' prefix-cache feeds where they have one
    approx_block_size: int = 16  # block size assumed for replicas without a feed
    approx_capacity_blocks: int = 65536  # how many blocks an approximate index remembers per replica
    timeouts: Timeouts = field(default_factory=Timeouts)  # per replica: probes, connects, silence mid-answer
    class_targets: bool = False  # place by what the request's class target leaves (fleet.router_class_targets)
    opening_limit: int = 2  # requests placed at once, the rest wait (opening_gate; 0: no limit)
    opening_hold_s: float = 0.05  # longest one request keeps its place while it waits on a replica


@dataclass
class Replica:
    """The router's view of one replica."""

    name: str
    client: RemoteBackend
    healthy: bool = False
    draining: bool = False  # the replica says so on /health
    held: bool = False  # the router sends it nothing new (drain()): kept apart, as /health rewrites draining
    failures: int = 0
    successes: int = 0
    load: BackendStats = field(default_factory=lambda: BackendStats(ready=False))
    inflight: int = 0
    index: PrefixIndex = field(default_factory=PrefixIndex)
    has_feed: bool = False
    feed_seq: int = 0
    model_key: str | None = None
    block_size: int = 16
    error: str | None = None
    served: int = 0
    ttft: TtftEstimate = field(default_factory=TtftEstimate)  # what a new request waits here (class targets)

    @property
    def waiting(self) -> int:
        return self.load.num_requests_waiting or 0

    def state(self, cached_blocks: int, prefill_tokens: int = 0) -> ReplicaState:
        """For a request of which this replica holds `cached_blocks` leading blocks and would prefill
        `prefill_tokens`."""
        # The router's in-flight count is fresher than a scrape up to one interval old.
        running = max(self.inflight, self.load.num_requests_running or 0)
        return ReplicaState(self.name, self.healthy, self.draining or self.held, self.load.kv_cache_usage_perc or 0.0,
                            running, self.waiting, cached_blocks, self.ttft.expected(self.waiting, prefill_tokens))


class Router(Backend):
    """Replicas of `model`, reached by URL (or given as RemoteBackend clients)."""

    def __init__(self, model: str, replicas: Sequence[str | RemoteBackend], config: RouterConfig | None = None,
                 tokenizer=None, api_key: str | None = None) -> None:
        if not replicas:
            raise ValueError(f"model {model!r} has no replica URLs")
        self.model = model
        self.config = config or RouterConfig()
        self.policy = make_policy(self.config.policy, self.config.weights)
        self._opening = OpeningGate(self.config.opening_limit, self.config.opening_hold_s)
        self._tokenizer = tokenizer
        self.replicas: list[Replica] = []
        for i, r in enumerate(replicas):
            client = r if isinstance(r, RemoteBackend) else RemoteBackend(r, model, api_key, tokenizer,
                                                                          self.config.timeouts)
            self.replicas.append(Replica(client.base_url, client, index=PrefixIndex(self.config.approx_capacity_blocks)))
        if len({r.name for r in self.replicas}) != len(self.replicas):
            raise ValueError(f"model {model!r} lists the same replica URL twice")
        self._tasks: list[asyncio.Task] = []
        self._feeds: dict[str, asyncio.Task] = {}  # replica name -> its prefix-cache feed follower
        self._api_key = api_key
        self._started = False
        self._error: str | None = None
        self._context_window = 0
        self._ids = itertools.count()
        self._current: dict[str, tuple[Replica, str]] = {}  # request id -> (replica, sub-request id)
        self._aborted: set[str] = set()
        # Rounds whose KV cache a replica keeps for the tool loop: request id -> (replica, sub-request id).
        # Their resume goes to that replica, which adopts the cache (engine/kv_holds.py).
        self._kept: dict[str, tuple[Replica, str]] = {}
        self.failovers = 0

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Probe every replica; eject (with a log line) those that cannot serve; fail if none can."""
        await asyncio.gather(*(self._admit(r, first=True) for r in self.replicas))
        if not any(r.healthy for r in self.replicas):
            reasons = "; ".join(r.error or "no answer" for r in self.replicas)
            self._error = f"no replica of {self.model!r} can serve: {reasons}"
            raise BackendNotReady(self._error)
        self._started = True
        self._tasks.append(asyncio.create_task(self._health_loop(), name=f"router-health-{self.model}"))
        if self.config.follow_feeds:
            for r in self.replicas:
                self._feeds[r.name] = asyncio.create_task(self._feed_loop(r), name=f"router-feed-{r.name}")

    async def close(self) -> None:
        tasks = [*self._tasks, *self._feeds.values()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        self._feeds.clear()
        await asyncio.gather(*(r.client.close() for r in self.replicas), return_exceptions=True)

    async def _admit(self, r: Replica, first: bool = False) -> bool:
        """Probe /v1/models (right model?) and /health; mark healthy or say why not."""
        try:
            info = await r.client.probe()
            status = await r.client.health()
        except (ReplicaError, BadGenerationRequest) as exc:
            if first or r.error != str(exc):
                log.warning("replica %s ejected: %s", r.name, exc)
            r.healthy, r.error = False, str(exc)
            return False
        if info.max_model_len:
            self._context_window = min(self._context_window or info.max_model_len, info.max_model_len)
        r.draining = status == "draining"
        r.healthy = status in ("ok", "draining")
        r.error = None if r.healthy else f"replica is {status}"
        r.failures = 0
        if r.healthy and not first:
            log.warning("replica %s is back", r.name)
        return r.healthy

    # -- health and load ----------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            await asyncio.gather(*(self._check(r) for r in self.replicas), return_exceptions=True)

    async def _check(self, r: Replica) -> None:
        try:
            status = await r.client.health()
            if status == "loading":
                raise ReplicaError("still loading its model")
            load = await r.client.load()
        except ReplicaError as exc:
            r.successes = 0
            r.failures += 1
            if r.healthy and r.failures >= self.config.eject_after:
                self._eject(r, str(exc))
            return
        r.load = load
        r.failures = 0
        was_draining, r.draining = r.draining, status == "draining"
        if r.draining and not was_draining:
            log.warning("replica %s is draining: no new requests go there", r.name)
        if not r.healthy:
            r.successes += 1
            if r.successes >= self.config.recover_after:
                r.successes = 0
                await self._admit(r)

    def _eject(self, r: Replica, reason: str) -> None:
        if r.healthy:
            log.warning("replica %s ejected: %s", r.name, reason)
        r.healthy, r.error, r.successes = False, reason, 0

    async def _feed_loop(self, r: Replica) -> None:
        """Follow the replica's prefix-cache feed; catch up (or resync from a snapshot) after breaks."""
        while True:
            try:
                body = await r.client.kv_events(r.feed_seq, wait=5.0 if r.has_feed else 0.0)
            except (ReplicaError, BadGenerationRequest):
                await asyncio.sleep(max(0.2, self.config.health_interval))
                continue
            if body is None:  # no feed (vLLM, SGLang): the approximate index stays in use
                r.has_feed = False
                return
            if not r.has_feed:
                r.index = PrefixIndex()  # exact from now on
                r.has_feed = True
            r.model_key, r.block_size = str(body.get("model_key", "")), int(body.get("block_size", 16))
            if body.get("reset"):
                r.index.replace(body.get("snapshot") or [])
            for e in body["events"]:
                if e.get("type") == "stored":
                    r.index.add(e.get("keys") or [])
                elif e.get("type") == "removed":
                    r.index.remove(e.get("keys") or [])
                elif e.get("type") == "cleared":
                    r.index.clear()
            r.feed_seq = body["last_seq"]

    # -- the Backend API -------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._started

    @property
    def load_error(self) -> str | None:
        return self._error

    @property
    def model_ids(self) -> list[str]:
        return [self.model]

    @property
    def context_window(self) -> int:
        return self._context_window or 2048

    @property
    def tokenizer(self):
        return self._tokenizer

    def count_tokens(self, text: str) -> int:
        return count_text_tokens(self._tokenizer, text)

    def count_prompt_tokens(self, messages: list[dict]) -> int:
        return count_chat_tokens(self._tokenizer, messages)

    def stats(self) -> BackendStats:
        live = [r.state(0) for r in self.replicas if r.healthy]
        return BackendStats(
            ready=self._started, model=self.model, policy=self.policy.name, context_window=self.context_window,
            failovers=self.failovers, num_requests_running=sum(s.num_running for s in live),
            num_requests_waiting=sum(s.num_waiting for s in live),
            kv_cache_usage_perc=(sum(s.kv_cache_usage for s in live) / len(live)) if live else 0.0,
            replicas=[ReplicaStatus(r.name, r.healthy, r.draining or r.held, r.inflight, r.served, r.has_feed,
                                    len(r.index), r.error, r.load) for r in self.replicas])

    def drain(self, url: str, draining: bool = True) -> None:
        """Send no new requests to `url` (its answers in flight finish); False undoes it."""
        r = self._replica(url)
        r.held = draining
        log.warning("replica %s %s by the router", r.name, "draining" if draining else "undrained")

    def _replica(self, url: str) -> Replica:
        for r in self.replicas:
            if r.name == url.rstrip("/"):
                return r
        raise ValueError(f"no replica {url!r} for model {self.model!r}")

    def inflight(self, url: str) -> int:
        """Requests the router has running on `url` now."""
        return self._replica(url).inflight

    async def add_replica(self, url: str) -> bool:
        """Route over one more replica (a fleet growing): probed like the first ones, then it takes new
        requests at once if healthy, or once the health checks find it so. Whether it is healthy now."""
        if any(r.name == url.rstrip("/") for r in self.replicas):
            raise ValueError(f"model {self.model!r} already routes over {url!r}")
        client = RemoteBackend(url, self.model, self._api_key, self._tokenizer, self.config.timeouts)
        r = Replica(client.base_url, client, index=PrefixIndex(self.config.approx_capacity_blocks))
        healthy = await self._admit(r, first=True)
        self.replicas.append(r)
        if self._started and self.config.follow_feeds:
            self._feeds[r.name] = asyncio.create_task(self._feed_loop(r), name=f"router-feed-{r.name}")
        return healthy

    async def remove_replica(self, url: str) -> None:
        """Stop routing over `url` for good; drain() it first and wait for inflight() to reach 0, so
        no answer is cut."""
        r = self._replica(url)
        if len(self.replicas) == 1:
            raise ValueError(f"{url!r} is the last replica of {self.model!r}")
        self.replicas.remove(r)
        task = self._feeds.pop(r.name, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await r.client.close()

    async def embed(self, inputs: list[EmbedInput], model: str | None = None) -> Embeddings:
        """On the least busy healthy replica; another one if it fails (the request's own fault, a 4xx,
        is no reason to try again)."""
        self.resolve_model(model)
        last: Exception | None = None
        for r in sorted((r for r in self.replicas if r.healthy and not (r.draining or r.held)), key=lambda r: r.inflight):
            r.inflight += 1
            try:
                return await r.client.embed(inputs)
            except ReplicaError as exc:
                last = exc
            finally:
                r.inflight -= 1
        raise BackendError(f"no replica of {self.model!r} could embed the input: {last or 'none is healthy'}")

    def hold_kv(self, request_id: str, tools: list[str], policy: str, timeout_s: float) -> None:
        kept = self._kept.get(request_id)
        if kept is not None:
            kept[0].client.hold_kv(kept[1], tools, policy, timeout_s)

    def release_kv(self, request_id: str) -> None:
        kept = self._kept.pop(request_id, None)
        if kept is not None:
            kept[0].client.release_kv(kept[1])

    def hold_background(self, held: bool) -> None:
        for replica in self.replicas:
            replica.client.hold_background(held)

    def abort(self, request_id: str) -> None:
        self.release_kv(request_id)
        current = self._current.get(request_id)
        if current is not None:
            self._aborted.add(request_id)
            replica, sub_id = current
            replica.client.abort(sub_id)

    # -- placement -------------------------------------------------------------------------------
    def _block_keys(self, r: Replica, ids: list[int], cache: dict) -> list[int]:
        key = (r.model_key or self.model, r.block_size if r.has_feed else self.config.approx_block_size)
        if key not in cache:
            cache[key] = prefix_block_keys(ids, key[1], key[0])
        return cache[key]

    def choose(self, ids: list[int], exclude: set[str], ttft_target_s: float | None = None) -> tuple[Replica, int]:
        """The replica for prompt `ids`, and how many of its tokens that replica would prefill."""
        cache: dict = {}
        candidates = [r for r in self.replicas if r.name not in exclude]
        prefill: dict[str, int] = {}
        states = []
        for r in candidates:
            cached = r.index.matched(self._block_keys(r, ids, cache))
            block = r.block_size if r.has_feed else self.config.approx_block_size
            prefill[r.name] = max(0, len(ids) - cached * block)
            states.append(r.state(cached, prefill[r.name]))
        any_keys = tuple(next(iter(cache.values()), ()))
        route = RouteRequest(len(ids), any_keys, self.model, ttft_target_s=ttft_target_s)
        name = self.policy.choose(route, states)
        chosen = next(r for r in candidates if r.name == name)
        if not chosen.has_feed:  # the approximate index learns from what it sends
            chosen.index.add(self._block_keys(chosen, ids, cache))
        self.policy.routed(route, name)
        return chosen, prefill[name]

    async def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The prompt's token ids: with the local tokenizer, else from a healthy replica's /tokenize."""
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if request.messages is None and request.prompt is None:
            raise BadGenerationRequest("a request needs messages or a prompt", param="messages")
        if self._tokenizer is not None:
            if request.messages is not None:
                return encode_chat(self._tokenizer, request.messages)
            return self._tokenizer.encode(request.prompt)
        last: Exception | None = None
        for r in sorted(self.replicas, key=lambda r: (not r.healthy, r.inflight)):
            try:
                return await r.client.tokenize(request.messages, request.prompt)
            except ReplicaError as exc:
                last = exc
        raise BackendError(f"no replica of {self.model!r} could tokenize the prompt: {last}")

    # -- generation ----------------------------------------------------------------------------------
    async def stream(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        if not self._started:
            raise BackendNotReady(self._error or f"the router for {self.model!r} is starting")
        self.resolve_model(request.model)
        params = sampling_params(request)
        if request.n > 1 or request.logprobs is not None or request.prompt_logprobs is not None:
            # Continuing an answer on another replica re-sends its tokens, which neither several choices
            # nor their logprobs survive.
            raise BadGenerationRequest("n above 1 and logprobs are not supported through the router",
                                       "unsupported_value", "n" if request.n > 1 else "logprobs")
        rid = request.request_id or f"route-{next(self._ids)}"
        # Tokenizing and placing it wait for a place at the gate. Its stream's request gives the place
        # back; so does the `finally` below, wherever the request ends before that (leave is idempotent).
        leave = await self._opening.enter()
        try:
            ids = await self.prompt_ids(request)
            if len(ids) >= self.context_window:
                raise BadGenerationRequest(f"the prompt has {len(ids)} tokens; this model's context window is "
                                           f"{self.context_window} tokens and the answer needs room too",
                                           "context_length_exceeded", "messages")
            answer = (AnswerProgress.resumed(params, self._tokenizer, request.resume_token_ids,
                                             request.resume_text)
                      if request.resume_token_ids else AnswerProgress(params, self._tokenizer))
            t0 = time.monotonic()
            first_token: float | None = None
            tried: set[str] = set()
            cached_tokens = 0
            for attempt in range(self.config.max_attempts):
                prompt = ids + answer.token_ids
                sub = answer.remaining_params()
                if sub is None:  # the dead replica had already produced the whole answer
                    yield answer.finish(answer.natural_finish(), len(ids), cached_tokens, self._metrics(t0, first_token, answer))
                    return
                kept = self._kept.pop(request.resume_of, None) if request.resume_of and attempt == 0 else None
                if kept is not None and kept[0].healthy and not kept[0].draining:
                    replica, sub, prefill = kept[0], replace(sub, resume_of=kept[1]), 0
                else:
                    try:
                        # What the class's target leaves, less the time spent here, until the first token.
                        target = request.ttft_target_s if self.config.class_targets and first_token is None else None
                        if target is not None:
                            target -= time.monotonic() - t0
                        replica, prefill = self.choose(prompt, tried, target)
                    except NoReplicaAvailable:
                        if not tried:
                            raise BackendError(f"no replica of {self.model!r} is healthy; try again shortly") \
                                from None
                        replica = None
                    sub = replace(sub, resume_of=None)  # the round's cache is on another replica, or gone
                if replica is None:
                    break
                sub_id = f"{rid}-{attempt}"
                self._current[rid] = (replica, sub_id)
                replica.inflight += 1
                sent, waiting = time.monotonic(), replica.waiting
                leave()
                try:
                    async for piece in replica.client.stream_tokens(prompt, sub, sub_id, priority=request.priority):
                        if rid in self._aborted:
                            break
                        text = answer.add(piece.token_ids, piece.text, piece.finish_reason is not None)
                        if piece.token_ids and first_token is None:
                            first_token = time.monotonic()
                            if sub.resume_of is None:  # a kept round's resume prefills little: not a sample
                                replica.ttft.observe(first_token - sent, waiting, prefill)
                        if answer.stopped:  # a stop string spanning the failover point
                            yield answer.finish("stop", len(ids), cached_tokens,
                                                self._metrics(t0, first_token, answer), text)
                            return
                        if piece.finish_reason is not None:
                            if attempt == 0 and piece.usage:
                                cached_tokens = (piece.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                            replica.served += 1
                            if sub.keep_kv:
                                self._kept[rid] = (replica, sub_id)
                                while len(self._kept) > MAX_KEPT:  # never told: the replica's grace frees it
                                    self._kept.pop(next(iter(self._kept)))
                            final = answer.finish(piece.finish_reason, len(ids), cached_tokens,
                                                  self._metrics(t0, first_token, answer), text)
                            final.token_ids = piece.token_ids
                            yield final
                            return
                        if text or piece.token_ids:
                            yield Delta(text, token_ids=piece.token_ids)
                    if rid in self._aborted:
                        yield answer.finish("abort", len(ids), cached_tokens, self._metrics(t0, first_token, answer))
                        return
                except ReplicaError as exc:
                    if rid in self._aborted:
                        yield answer.finish("abort", len(ids), cached_tokens, self._metrics(t0, first_token, answer))
                        return
                    tried.add(replica.name)
                    if isinstance(exc, ReplicaTimeout):  # busy or hung: health checks decide
                        replica.failures += 1
                    else:  # refused, reset, garbage: it is gone
                        self._eject(replica, str(exc))
                    if isinstance(exc, ReplicaModelMismatch):
                        log.error("replica %s: %s", replica.name, exc)
                    self.failovers += 1
                    log.warning("request %s: replica %s failed after %d tokens (%s); continuing elsewhere",
                                rid, replica.name, len(answer.token_ids), exc)
                    answer.failed_over()
                finally:
                    replica.inflight -= 1
            raise BackendError(f"the answer failed on {len(tried)} replica(s) of {self.model!r}; "
                               f"no other replica is available")
        finally:
            leave()
            self._current.pop(rid, None)
            self._aborted.discard(rid)

    @staticmethod
    def _metrics(t0: float, first_token: float | None, answer: AnswerProgress) -> Timings:
        now = time.monotonic()
        n = len(answer.token_ids)
        ttft = (first_token - t0) if first_token is not None else None
        tpot = (now - first_token) / (n - 1) if ttft is not None and n > 1 else None
        return Timings(ttft=ttft, tpot=tpot, e2e=now - t0)
