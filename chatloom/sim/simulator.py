"""The discrete-event loop: traffic in, the router's policy in front, simulated replicas behind.

Events sit on one heap ordered by simulated time: a new conversation, a message arriving, a replica's
step (or fast-forward run) ending. A replica is stepped only while it has work; an idle one costs
nothing. The router builds a `ReplicaState` per replica (its KV-cache manager's usage and how many of the
prompt's leading blocks its prefix cache holds, its Scheduler's queues) and asks the policy, exactly
the call the live router makes (chatloom.serving.routing).

Fleet scale: a large fleet is split into cells, each with its own router over `cell_size` replicas,
and each conversation belongs to one cell (a gateway hashing the conversation id). Cells share
nothing, so the fleet's figures are the cells' figures pooled, and a sample of cells, each getting its
share of the traffic, estimates them (see `run_fleet`).
"""
from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from chatloom.engine import block_hash
from chatloom.serving.routing import NoReplicaAvailable, ReplicaState, RouteRequest, RoutingPolicy, TtftEstimate
from chatloom.sim.cost import decode_step_s, loaded_step_s
from chatloom.sim.early_stop import EarlyStop, Tally
from chatloom.sim.hardware import ReplicaSpec
from chatloom.sim.replica import SimReplica, SimRequest, sim_block_key, sim_prefix_keys
from chatloom.sim.request_table import RequestLog, RequestTable
from chatloom.sim.arrivals import SimConversation, TrafficModel, TrafficSource

_STEP, _ARRIVAL, _CONVERSATION, _TRACED = 0, 1, 2, 3
SNAPSHOT_ANSWERS = 1  # a snapshot start's warm-up, in mean answers' time


@dataclass
class SimConfig:
    duration_s: float
    warmup_s: float = 0.0            # requests arriving earlier are not counted
    queue_timeout_s: float = 60.0    # waiting longer than this, never scheduled: refused (503)
    seed: int = 0
    enable_prefix_caching: bool = True
    check_invariants: bool = False   # tests: check every replica's KV after every step
    # Traffic starts this long before t=0 (None: the default of the start below), so that the
    # replicas' batches, queues and prefix caches are at their steady state by then.
    prewarm_s: float | None = None
    # Start from the steady state's conversations under way, their histories in the replicas' prefix
    # caches (TrafficSource.in_progress), a few answers' time before t=0; False: from no
    # conversation at all, two mean conversation lifetimes before (several times the requests).
    snapshot: bool = True
    # Reuse the first tokens of a cached block as the engine does (False: whole blocks only; faster,
    # and the conversation traffic's prompts rarely part from a cached block within a block).
    partial_block_hits: bool = True
    # Time-to-first-token targets by traffic class ('interactive', 'interactive:<tier>', 'reasoning'),
    # in seconds: requests carry them to the routing policy, and each replica keeps the estimate of a
    # new request's wait the live router keeps (serving/routing.py). Empty: no targets.
    ttft_targets: dict[str, float] = field(default_factory=dict)
    # After duration_s no message is sent; what is in flight runs to its end.


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def new_replicas(name_prefix: str, n: int, spec: ReplicaSpec, config: SimConfig) -> list[SimReplica]:
    # Tens of thousands of blocks a replica: with the collector on, making them set off full passes
    # over the heap (1.5 s for the first two replicas of a plan).
    with gc_paused():
        return [SimReplica(f"{name_prefix}{i}", spec, config.enable_prefix_caching, config.partial_block_hits)
                for i in range(n)]


@dataclass
class SimRun:
    """What one simulation produced: every request (or, run with keep_requests=False, only their
    figures in `table`), the replicas, and its own cost."""

    requests: list[SimRequest]
    replicas: list[SimReplica]
    config: SimConfig
    sim_seconds: float
    wall_seconds: float
    events: int
    routed: list[tuple[RouteRequest, tuple[ReplicaState, ...], str]] = field(default_factory=list)
    log: RequestLog | None = None
    stopped: bool = False  # ended early (EarlyStop): what was in flight is unfinished
    stop_reason: str = ""  # then why: "missed", "meets" or "first tokens"
    in_flight: list[SimRequest] = field(default_factory=list)  # stopped, keeping no requests: those unfinished

    @property
    def table(self) -> RequestTable:
        if self.log is None:
            return RequestTable.from_requests(self.requests)
        if self.in_flight:
            return RequestTable.concat([self.log.table(), RequestTable.from_requests(self.in_flight)])
        return self.log.table()


class Simulator:
    def __init__(self, spec: ReplicaSpec, num_replicas: int, policy: RoutingPolicy | None,
                 traffic: TrafficModel | None, config: SimConfig, record_routes: bool = False,
                 progress: Callable[[float], None] | None = None, name_prefix: str = "r",
                 trace: list[SimRequest] | None = None, keep_requests: bool = True,
                 early_stop: EarlyStop | None = None) -> None:
        """`traffic` draws conversations; or `trace` replays given requests (arrival, prompt, answer).
        `policy` may be None only for a single replica (there is no choice to make). With
        `keep_requests` False, a request's figures go to a RequestLog when it ends and the request
        itself (its token lists) is dropped: memory follows the requests in flight, not the run.
        With an `early_stop`, the run stops once its answer is known (requests still in flight are
        unfinished) and `resume` may take it on from there."""
        if num_replicas < 1:
            raise ValueError("a fleet needs at least one replica")
        if policy is None and num_replicas > 1:
            raise ValueError("a fleet of several replicas needs a routing policy")
        if (traffic is None) == (trace is None):
            raise ValueError("give either a traffic model or a trace")
        if config.duration_s <= 0:
            raise ValueError("the simulated duration must be positive")
        self.spec = spec
        self.policy = policy
        self.traffic = traffic
        self.config = config
        self.replicas = new_replicas(name_prefix, num_replicas, spec, config)
        self.by_name = {r.name: r for r in self.replicas}
        for r in self.replicas:
            r.on_finish = self._finished
        self.source = TrafficSource(traffic, config.seed, max_model_len=spec.max_model_len) if traffic else None
        self.trace = trace or []
        self.root = block_hash.root_key(spec.model_key)
        self.requests: list[SimRequest] = []
        self.log = None if keep_requests else RequestLog()
        self._live: dict[str, SimRequest] = {}  # without keep_requests: admitted, not yet ended
        self.tally = Tally(early_stop) if early_stop is not None else None
        # Each replica's estimate of a new request's wait, kept only where requests have targets.
        self._ttft = {r.name: TtftEstimate() for r in self.replicas} if config.ttft_targets else {}
        if self.tally is not None or self._ttft:
            for r in self.replicas:
                r.on_first_token = self._first_token
        self.record_routes = record_routes
        self.routed: list = []
        self.progress = progress
        self._heap: list = []
        # The loop's state between a stop and a resume.
        self._begun = False
        self._events, self._last_progress, self._last_work, self._wall = 0, 0.0, 0.0, 0.0
        self._tie = itertools.count()
        self._ids = itertools.count()
        self._last_expiry: dict[str, float] = {}
        self.now = 0.0

    # -- events --------------------------------------------------------------------------
    def _push(self, t: float, kind: int, obj, version: int = 0) -> None:
        heapq.heappush(self._heap, (t, next(self._tie), kind, obj, version))

    def run(self) -> SimRun:
        # Millions of long-lived Block and Sequence objects: the cyclic collector's full passes would
        # dominate the run. The simulator makes no reference cycles it relies on the collector for
        # (and drops its own at the end: see close), so none is collected first either (a full pass
        # over the interpreter's heap took 0.6 s a probe).
        gc.freeze()
        try:
            with gc_paused():
                return self._run()
        finally:
            gc.unfreeze()

    def close(self) -> None:
        """Drop the replicas' callbacks into this simulator, the one reference cycle it makes, so that
        once it is let go its objects are freed at once by reference counting. A finished run does
        this itself; a stopped one that will not be resumed needs it."""
        for r in self.replicas:
            r.on_finish = r.on_first_token = None

    def resume(self, early_stop: EarlyStop | None = None) -> SimRun:
        """Take a stopped run on from where it stopped, under a new rule (None: to its end). The
        window's requests counted so far stay counted."""
        if not self._begun or self.tally is None:
            raise RuntimeError("resume: only a run that was stopped early can be resumed")
        if early_stop is None:
            self.tally = None
        else:
            self.tally.rule, self.tally.reason = early_stop, ""
        return self.run()

    def _begin(self) -> None:
        cfg = self.config
        if self.source is not None:
            start = -self.prewarm_s()
            self.now = start
            if cfg.snapshot:
                self._snapshot(start)
            first = self.source.next_conversation_time(start, cfg.duration_s)
            if first is not None:
                self._push(first, _CONVERSATION, None)
        for req in self.trace:
            self._push(req.arrival, _TRACED, req)
        self._last_work = self.now

    def _run(self) -> SimRun:
        cfg = self.config
        t0 = time.perf_counter()
        if not self._begun:
            self._begin()
            self._begun = True
        events, last_progress, last_work = self._events, self._last_progress, self._last_work
        heap, tally = self._heap, self.tally
        while heap and not (tally is not None and tally.reason):
            t, _, kind, obj, version = heapq.heappop(heap)
            self.now = t
            events += 1
            if kind == _STEP:
                if version == obj.version:
                    self._step_end(obj, t)
            elif kind == _ARRIVAL:
                if t < cfg.duration_s:
                    self._arrive(obj, t)
                else:  # a message after the end is never sent: the run does not last until then
                    self.now = last_work
                    continue
            elif kind == _TRACED:
                self._admit(obj, t)
            elif kind == _CONVERSATION:
                self._push(t, _ARRIVAL, self.source.new_conversation())
                nxt = self.source.next_conversation_time(t, cfg.duration_s)
                if nxt is not None:
                    self._push(nxt, _CONVERSATION, None)
            else:
                self._dispatch(kind, obj, t)
            last_work = t
            if self.progress is not None and t - last_progress >= 1.0:
                self.progress(t - last_progress)
                last_progress = t
        self._events, self._last_progress, self._last_work = events, last_progress, last_work
        self._wall += time.perf_counter() - t0
        reason = tally.reason if tally is not None else ""
        span = self.now + (self.prewarm_s() if self.source is not None else 0.0)
        in_flight = list(self._live.values()) if reason else []
        if not reason:
            self.close()
        if self.log is not None and not reason:
            for req in self._live.values():  # none when every request ran to its end
                self.log.add(req)
            self._live.clear()
        return SimRun(self.requests, self.replicas, cfg, span, self._wall, events, self.routed,
                      self.log, bool(reason), reason, in_flight)

    def prewarm_s(self) -> float:
        if self.config.prewarm_s is not None:
            return self.config.prewarm_s
        if self.source is None:
            return 0.0
        m = self.source.model
        if self.config.snapshot:
            # Conversations are under way from the start; what is left to fill is the replicas' batches,
            # which hold an answer for its whole length: a few mean answers' time, at the decode step.
            return SNAPSHOT_ANSWERS * m.mean_answer_tokens * decode_step_s(self.spec, m)
        # A turn lasts a think time plus an answer's streaming (at ~30 ms a token); two conversation
        # lifetimes bring the number of conversations in progress close to its steady state.
        return 2 * m.mean_turns * (m.think_time_s + 0.03 * m.mean_answer_tokens)

    def _token_s(self) -> float:
        """An answer's time per token: the step of a replica at its share of the traffic's rate."""
        share = self.source.model.rate(-self.prewarm_s()) / max(len(self.answer_targets()), 1)
        return loaded_step_s(self.spec, self.source.model, share)

    def _snapshot(self, start: float) -> None:
        """The conversations under way at `start` (TrafficSource.in_progress). A thinking one's history
        goes into a replica's prefix cache as if that replica had answered it, and its next message is
        scheduled; an answering one joins a replica's running batch with its answer partly made (its
        next message follows when it ends, as any other's). Spread evenly, as the load-based policies
        spread new conversations."""
        under_way = self.source.in_progress(start, self._token_s())
        # Longest idle first: the most recently active histories are the last to be evicted.
        thinking = sorted((c for c in under_way if c.answering is None), key=lambda c: -c.idle)
        targets = self.warm_targets()
        for i, c in enumerate(thinking):
            if c.conversation.turns:
                targets[i % len(targets)].warm(self.source.history(c.conversation))
            if c.delay is not None and start + c.delay < self.config.duration_s:
                self._push(start + c.delay, _ARRIVAL, c.conversation)
        targets, started = self.answer_targets(), set()
        for i, c in enumerate(c for c in under_way if c.answering is not None):
            prompt, rest, reasoning, since = c.answering
            conv = c.conversation
            req = SimRequest(f"q{next(self._ids)}", start - since, prompt, rest, conv.tier.priority, conv.tier.name,
                             reasoning, conv)
            req.first_scheduled = req.first_token = req.arrival
            req.under_way = True
            replica = targets[i % len(targets)]
            self._track(req)
            if replica.receive(req, start):
                started.add(replica)
            else:  # no room left on that replica: it ended just now
                req.finished = start
                self._next_turn(req, start)
        for replica in started:
            self._kick(replica, start)

    def warm_targets(self) -> list[SimReplica]:
        """The replicas a conversation's earlier turns ran on."""
        return self.replicas

    def answer_targets(self) -> list[SimReplica]:
        """The replicas that make answers' tokens."""
        return self.replicas

    def _dispatch(self, kind: int, obj, t: float) -> None:
        """Events of kinds a subclass adds (disaggregation's KV transfers)."""
        raise RuntimeError(f"unknown event kind {kind}")

    # -- arrivals and routing ------------------------------------------------------------------
    def _keys(self, conv: SimConversation, prompt: list[int]) -> list[int]:
        """The prompt's full-block keys, extending those of the conversation's previous prompt."""
        bs = self.spec.block_size
        prev = conv.tokens
        if prev and len(prev) <= len(prompt) and prompt[:len(prev)] == prev:
            keys = conv.keys
        else:
            keys = []
        parent = keys[-1] if keys else self.root
        for i in range(len(keys), len(prompt) // bs):
            parent = sim_block_key(parent, tuple(prompt[i * bs:(i + 1) * bs]))
            keys.append(parent)
        conv.tokens, conv.keys = prompt, keys
        return keys

    def states(self, keys: tuple[int, ...], prompt_tokens: int = 0) -> list[ReplicaState]:
        out = []
        for r in self.replicas:
            s = r.sched
            cached = r.cached_prefix_blocks(keys)
            estimate = self._ttft.get(r.name)  # (none without targets, nor in a disaggregated fleet's pools)
            expected = estimate.expected(r.num_queued, self._prefill_tokens(prompt_tokens, cached)) \
                if estimate is not None else None
            out.append(ReplicaState(name=r.name, kv_cache_usage=r.kv.usage, num_running=len(s.running),
                                    num_waiting=r.num_queued, cached_blocks=cached, expected_ttft_s=expected))
        return out

    def _prefill_tokens(self, prompt_tokens: int, cached_blocks: int) -> int:
        """The tokens a replica holding `cached_blocks` leading blocks would prefill, as the router counts."""
        return max(0, prompt_tokens - cached_blocks * self.spec.block_size)

    def ttft_target(self, req: SimRequest) -> float | None:
        """The request's class target (config.ttft_targets): its own class's, else its kind's."""
        targets = self.config.ttft_targets
        if req.reasoning:
            return targets.get("reasoning")
        return targets.get(f"interactive:{req.tier}", targets.get("interactive"))

    def _arrive(self, conv: SimConversation, t: float) -> None:
        turn = self.source.next_turn(conv)
        keys = tuple(self._keys(conv, turn.prompt))
        req = SimRequest(f"q{next(self._ids)}", t, turn.prompt, turn.answer, conv.tier.priority, conv.tier.name,
                         turn.reasoning, conv, keys)
        self._admit(req, t)

    def _track(self, req: SimRequest) -> None:
        if self.log is None:
            self.requests.append(req)
        else:
            self._live[req.rid] = req

    def _admit(self, req: SimRequest, t: float) -> None:
        self._track(req)
        if self.tally is not None:
            self.tally.sent_one(req)
        if not req.block_keys and self.policy is not None:
            req.block_keys = tuple(sim_prefix_keys(req.prompt, self.spec.block_size, self.root))
        if len(req.prompt) + len(req.answer) > self.spec.pool_tokens:
            req.refused = "longer_than_kv_pool"
            self._next_turn(req, t)
            return
        self.route(req, t)

    def route(self, req: SimRequest, t: float) -> None:
        if self.policy is None:
            replica = self.replicas[0]
            replica.add(req, t)
            self._kick(replica, t)
            return
        # The same request the live router (serving/router.py) builds: size, block keys, model.
        rr = RouteRequest(prompt_tokens=len(req.prompt), block_keys=req.block_keys, model=self.spec.model_key,
                          ttft_target_s=self.ttft_target(req))
        states = self.states(req.block_keys, len(req.prompt))
        try:
            name = self.policy.choose(rr, states)
        except NoReplicaAvailable:
            req.refused = "no_replica"
            self._next_turn(req, t)
            return
        self.policy.routed(rr, name)
        if self.record_routes:
            self.routed.append((rr, tuple(states), name))
        replica = self.by_name[name]
        if name in self._ttft:  # the estimate's inputs, for when the first token comes
            req.waiting_at_route = replica.num_queued
            cached = next(s for s in states if s.name == name).cached_blocks
            req.prefill_at_route = self._prefill_tokens(len(req.prompt), cached)
        replica.add(req, t)
        self._kick(replica, t)

    def _kick(self, replica: SimReplica, t: float) -> None:
        """New work on `replica`: start it if idle, else end its fast-forward run at the step in flight."""
        if not replica.busy:
            end = replica.start(t)
            if end is not None:
                self._push(end, _STEP, replica, replica.version)
        else:
            end = replica.cut_short(t)
            if end is not None:
                self._push(end, _STEP, replica, replica.version)

    # -- steps -----------------------------------------------------------------------------
    def _step_end(self, replica: SimReplica, t: float) -> None:
        replica.finish(t)
        if self.config.check_invariants:
            replica.check_kv()
        timeout = self.config.queue_timeout_s
        if replica.sched.waiting and t - self._last_expiry.get(replica.name, -1e9) >= min(1.0, timeout / 4):
            self._last_expiry[replica.name] = t
            for req in replica.expire_waiting(t, timeout):
                self._next_turn(req, t)
        end = replica.start(t)
        if end is not None:
            self._push(end, _STEP, replica, replica.version)

    def _first_token(self, req: SimRequest, t: float) -> bool:
        if self.tally is not None:
            self.tally.first_token(req, t)
        if req.replica in self._ttft and not req.under_way:
            self._ttft[req.replica].observe(req.first_token - req.arrival, req.waiting_at_route, req.prefill_at_route)
        return False  # the request goes on here (a prefill replica of disagg.py hands it on instead)

    def _finished(self, req: SimRequest, t: float) -> None:
        self._next_turn(req, t)

    def _next_turn(self, req: SimRequest, t: float) -> None:
        """`req` has ended (answered or refused): record it, and send its conversation's next message."""
        if self.log is not None and self._live.pop(req.rid, None) is not None:
            self.log.add(req)
        if self.tally is not None:
            self.tally.ended(req, t)
        conv = req.conversation
        if conv is not None and conv.turns_left > 0:
            self._push(t + self.source.think_time(), _ARRIVAL, conv)
