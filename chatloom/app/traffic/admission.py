"""The admission queue in front of the engine.

The engine's own KV room decides when the next request starts: a waiting request is let in only
when the backend says its prompt's blocks are free (and nothing is already queued inside the
engine). Among the waiting, higher tiers go first, but a tier with a reserved share keeps at least
that share of recent admissions, so the free tier slows under load and never starves. Within a tier,
requests go by their deadline: arrival plus their class's time-to-first-token target (`ttft_target`), so
a chat message starts before a reasoning request that came earlier but whose target (its thinking is
hidden) leaves it time; with equal targets that is arrival order. Reasoning
requests (long hidden thinking) may hold at most `reasoning_share` of the running slots, so they
cannot crowd out interactive chat. A request that waits longer than `max_wait_s` leaves with
QueueTimeout (a 503) having cost no model work.

The queue is bounded by what it can serve in time. Each generation's run time is measured when it
ends; the service rate is the running slots over the mean run time. An arriving request whose
expected wait (the requests ahead of it in its tier's order, or its tier's reserved share of the
admissions, whichever is sooner) exceeds `max_wait_s` is refused at once with QueueFull (a 503 with
Retry-After) instead of waiting out the timeout, unless `before_refusing` takes a step of the degrade
ladder for it instead (then it waits, and times out if the cheaper answers do not make room in time).
`refuse_if_full` makes that decision synchronously, before a ticket, a future or a task exists for the
request, so callers can refuse a burst's excess in the same step that received it (a refusal then costs
microseconds, not a turn of the event loop behind every other arrival). Until a few runs are measured
nothing is refused early: the wait for a slot is bounded below only by how soon running generations
end, and without a measured pace that bound is zero, so any earlier refusal would be a guess that
refuses work a fast engine could do.
With several gateways, `fleet` (a hotstate.fleet_shares.FleetShares) adds the other gateways'
generations and admissions to both shares.

Batch requests (the Batch API) form a class below every interactive tier: one is admitted only while no
interactive or reasoning request waits, and batch requests together hold at most `batch_share` of the
running slots (at most `batch_busy_slots` while interactive requests run or wait), so an interactive
arrival finds a free slot at once. They never time out and are never
refused for a full queue (work that can wait, waits); their tier's reserved share does not apply to them
and their admissions do not count in the shares of recent admissions. When an interactive request still
cannot start (no slot, or no KV room, while batch requests hold some), the newest running batch request
is asked to give way (`Slot.on_yield`): its run stops and its batch runs it again later; one at a time,
each once the one before has let its slot go and the engine has had `YIELD_INTERVAL_S` to free its blocks.
While an interactive or reasoning request waits for a slot or for its user's first output (the output
check may hold the engine's first tokens back), the batch runner holds its own work on the event loop back
(`until_interactive_started`) and `on_starting` has the engine hold batch sequences out of its steps.
"""
from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from typing import Awaitable, Callable

from chatloom.app.traffic.queue_errors import QueueFull, QueueTimeout  # noqa: F401 (imported from here)
from chatloom.app.traffic.queue_ticket import BATCH, INTERACTIVE, REASONING, Ticket  # noqa: F401 (as above)
from chatloom.app.traffic.tiers import Tier


MIN_MEASURED_RUNS = 3  # runs measured before the queue refuses early
_ARRIVING = 2 ** 62  # the seq of a request not yet in the queue: after every waiting one
YIELD_INTERVAL_S = 0.25  # between two batch requests asked to give way (an abort frees blocks within a step)


class Slot:
    """A granted place in the engine; release() when the generation ends."""

    def __init__(self, queue: "AdmissionQueue", ticket: Ticket, waited_s: float) -> None:
        self._queue = queue
        self.ticket = ticket
        self.waited_s = waited_s
        self.pending = True  # granted, but the engine has not produced anything for it yet
        self.released = False
        self.ran = False
        self.started_at = time.monotonic()
        self.on_yield: Callable[[], None] | None = None  # batch runs: stop now, to be run again later
        self.yielding = False
        self.starting = ticket.kind != BATCH  # counted in the queue's _starting until shown()

    def started(self, shown: bool = True) -> None:
        """The engine has taken the request in: its prompt no longer counts as pending. `shown`: its first
        output has reached the user too (else shown() follows: the output check may hold it back)."""
        if self.pending:
            self.pending = False
            self._queue._pending_tokens -= self.ticket.prompt_tokens
            self._queue._kick()
        if shown:
            self.shown()

    def shown(self) -> None:
        """The user has the answer's first output: batch work no longer waits for this request."""
        if self.starting:
            self.starting = False
            self._queue._starting -= 1
            self._queue._wake_quiet()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.ran = not self.pending  # the engine produced something for it
            self.started()
            self._queue._release(self)

    async def __aenter__(self) -> "Slot":
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()


class AdmissionQueue:
    def __init__(self, has_room: Callable[[int], bool], max_running: int, max_wait_s: float = 30.0,
                 reasoning_share: float = 0.5, share_window: int = 20, poll_s: float = 0.02,
                 on_wait: Callable[[Ticket, float, bool], None] | None = None, batch_share: float = 0.5,
                 batch_busy_slots: int | None = None,
                 ttft_target: Callable[[Tier, str], float | None] | None = None) -> None:
        self.has_room = has_room
        # Seconds to the first token a request of (tier, kind) is meant to get (its class's target); None: no
        # target, and such requests go by arrival after those whose target runs out within max_wait_s.
        self.ttft_target = ttft_target
        self.max_running = max(1, max_running)
        self.max_wait_s = max_wait_s
        self.reasoning_share = reasoning_share
        self.batch_share = batch_share
        self.batch_busy_slots = batch_busy_slots
        self.poll_s = poll_s
        self.on_wait = on_wait  # metrics: (ticket, seconds waited, admitted?)
        # Asked before refusing an arrival at once, with its expected wait: True lets it wait instead (the
        # degrade ladder took a step, control.py); None: refuse.
        # `joining`: the request joins the queue if not refused (enqueue), else it is only being checked early.
        self.before_refusing: Callable[[float, bool], bool] | None = None
        self._waiting: list[Ticket] = []
        self._running: dict[str, int] = {INTERACTIVE: 0, REASONING: 0, BATCH: 0}
        self._pending_tokens = 0
        self._starting = 0  # interactive and reasoning requests admitted whose user has no output yet
        self._quiet_waiters: list[asyncio.Future[None]] = []
        self.on_starting: Callable[[bool], None] | None = None  # told when interactive_starting() changes
        self._told_starting = False
        self._batch_slots: list[Slot] = []  # running batch requests, oldest first
        self._last_yield = -math.inf
        self._recent: deque[str] = deque(maxlen=share_window)  # tier names of the latest admissions
        self._seq = itertools.count()
        self._poller: asyncio.Task | None = None
        self._announcer: asyncio.Task | None = None
        self._avg_run_s = 5.0
        self._run_times: deque[float] = deque(maxlen=50)  # seconds each recent generation held its slot
        self.fleet = None  # FleetShares: the other gateways' figures, when several share the shares

    # -- figures ------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def oldest_wait_s(self) -> float:
        """How long the request waiting longest has waited so far (0 with none waiting)."""
        if not self._waiting:
            return 0.0
        return time.monotonic() - min(t.enqueued for t in self._waiting)

    @property
    def running(self) -> int:
        return sum(self._running.values())

    def running_of(self, kind: str) -> int:
        return self._running.get(kind, 0)

    def reasoning_slots(self) -> int:
        total = self.max_running + (self.fleet.others_max_running if self.fleet is not None else 0)
        return max(1, math.floor(total * self.reasoning_share))

    def batch_slots(self) -> int:
        """Running slots batch requests may hold (always leaving one for interactive arrivals; at most
        `batch_busy_slots` while interactive requests run or wait)."""
        slots = max(1, min(self.max_running - 1, math.floor(self.max_running * self.batch_share)))
        busy = self._running[INTERACTIVE] + self._running[REASONING] > 0 or self.interactive_waiting()
        return min(slots, self.batch_busy_slots) if busy and self.batch_busy_slots else slots

    def interactive_waiting(self) -> bool:
        return any(t.kind != BATCH for t in self._waiting)

    def interactive_starting(self) -> bool:
        """Whether an interactive or reasoning request waits for a slot or for its user's first output."""
        return self._starting > 0 or self.interactive_waiting()

    async def until_interactive_started(self) -> None:
        """Return once no interactive or reasoning request waits for a slot or for its first output (at
        once if none does). The batch runner holds its own work back until then, so that work does not
        share the event loop and the CPU with a request whose time to first token is running."""
        while self.interactive_starting():
            waiter = asyncio.get_running_loop().create_future()
            self._quiet_waiters.append(waiter)
            await waiter

    def _wake_quiet(self) -> None:  # where interactive_starting() may have changed
        starting = self.interactive_starting()
        if starting != self._told_starting and self.on_starting is not None:
            self._told_starting = starting
            self.on_starting(starting)
        if self._quiet_waiters and not starting:
            waiters, self._quiet_waiters = self._quiet_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def reasoning_running(self) -> int:
        """Reasoning generations running here, plus on the other gateways of the fleet."""
        return self._running[REASONING] + (self.fleet.others_reasoning if self.fleet is not None else 0)

    # -- admission ------------------------------------------------------------------
    async def admit(self, tier: Tier, prompt_tokens: int, kind: str = INTERACTIVE,
                    on_position: Callable[[int], Awaitable[None]] | None = None) -> Slot:
        """Wait for room; raises QueueFull at once, or QueueTimeout after max_wait_s. Cancelling the caller
        leaves the queue."""
        return await self.wait(self.enqueue(tier, prompt_tokens, kind, on_position))

    def enqueue(self, tier: Tier, prompt_tokens: int, kind: str = INTERACTIVE,
                on_position: Callable[[int], Awaitable[None]] | None = None) -> Ticket:
        """Join the queue now, in the caller's step (or raise QueueFull); then wait(ticket) for the slot.
        Joining synchronously matters under a burst: the next arrival, handled in the same turn of the
        event loop, already counts this one when it asks refuse_if_full."""
        self.refuse_if_full(tier, prompt_tokens, kind, joining=True)
        ticket = self._ticket(tier, prompt_tokens, kind, next(self._seq), on_position)
        ticket.future = asyncio.get_running_loop().create_future()
        self._waiting.append(ticket)
        self._dispatch()
        self._wake_quiet()
        if not ticket.future.done():
            self._ensure_poller()
        return ticket

    async def wait(self, ticket: Ticket) -> Slot:
        """The slot of an enqueued ticket; QueueTimeout once it has waited max_wait_s in all."""
        try:
            if not ticket.future.done():
                await self._announce()
            if ticket.kind == BATCH:  # work that can wait: no deadline (its caller may cancel)
                await asyncio.shield(ticket.future)
            else:
                remaining = self.max_wait_s - (time.monotonic() - ticket.enqueued)
                # Not wait_for over a shield: on Python 3.11 it swallows a cancellation of this request
                # that arrives as the slot is granted, and the request runs on for a client that is gone.
                await asyncio.wait({ticket.future}, timeout=max(0.0, remaining))
                if not ticket.future.done():
                    raise asyncio.TimeoutError
        except asyncio.TimeoutError:
            self._leave(ticket)
            waited = time.monotonic() - ticket.enqueued
            if self.on_wait:
                self.on_wait(ticket, waited, False)
            raise QueueTimeout(waited, self.retry_after()) from None
        except BaseException:
            self.abandon(ticket)
            raise
        slot = ticket.future.result()
        if self.on_wait:
            self.on_wait(ticket, slot.waited_s, True)
        return slot

    def abandon(self, ticket: Ticket) -> None:
        """The ticket's request is gone: leave the queue, or hand back the slot it was granted."""
        if ticket.future.done() and not ticket.future.cancelled():
            ticket.future.result().release()
        else:
            self._leave(ticket)

    def refuse_if_full(self, tier: Tier, prompt_tokens: int, kind: str = INTERACTIVE, joining: bool = False) -> None:
        """Raise QueueFull if a request arriving now could not start at once and, at the measured pace,
        would not get in within max_wait_s. Synchronous, and side-effect free unless it refuses or (when
        `joining`: the request joins the queue next) the degrade ladder steps instead."""
        if kind == BATCH:
            return  # batch requests wait as long as it takes
        arrival = self._ticket(tier, prompt_tokens, kind, _ARRIVING)
        if self._could_start(arrival):
            return
        expected = self.expected_wait(arrival)
        if expected is None or expected <= self.max_wait_s:
            return
        if self.before_refusing is not None and self.before_refusing(expected, joining):
            return  # the degrade ladder took a step instead: this request waits (and may still time out)
        if self.on_wait:
            self.on_wait(arrival, 0.0, False)
        retry = int(min(60, max(1, math.ceil(expected - self.max_wait_s))))
        raise QueueFull(expected, self.max_wait_s, retry)

    def _ticket(self, tier: Tier, prompt_tokens: int, kind: str, seq: int,
                on_position: Callable[[int], Awaitable[None]] | None = None) -> Ticket:
        ticket = Ticket(tier, prompt_tokens, kind, seq, on_position=on_position)
        target = self.ttft_target(tier, kind) if self.ttft_target is not None else None
        ticket.deadline = ticket.enqueued + (target if target is not None else self.max_wait_s)
        return ticket

    def _could_start(self, arrival: Ticket) -> bool:
        """Whether _dispatch would grant `arrival` at once if it joined the queue now."""
        if self.running >= self.max_running:
            return False
        order = self._order(arrival)
        return bool(order) and order[0] is arrival and self.has_room(arrival.prompt_tokens + self._pending_tokens)

    def mean_run_s(self) -> float | None:
        """The mean time a generation holds its slot, once enough runs are measured."""
        if len(self._run_times) < MIN_MEASURED_RUNS:
            return None
        return sum(self._run_times) / len(self._run_times)

    def expected_wait(self, ticket: Ticket) -> float | None:
        """Seconds until `ticket` (waiting, or arriving now) is admitted at the measured pace (None while
        unmeasured)."""
        mean = self.mean_run_s()
        if mean is None:
            return None
        slots = self.reasoning_slots() if ticket.kind == REASONING else self.max_running
        rate = slots / mean  # admissions per second while every slot is busy
        waiting = ticket in self._waiting
        order = self._order(None if waiting else ticket)
        ahead = order.index(ticket) if ticket in order else len(self._waiting) - (1 if waiting else 0)
        wait = (ahead + 1) / rate
        share = ticket.tier.reserved_share if ticket.kind != BATCH else 0.0
        if share > 0:  # its tier is guaranteed this share of admissions, however many outrank it
            same = sum(1 for t in self._waiting if t.tier.name == ticket.tier.name
                       and (t.deadline, t.seq) < (ticket.deadline, ticket.seq))
            wait = min(wait, (same + 1) / (rate * share))
        return wait

    def retry_after(self) -> int:
        """A guess at when a retry would get in: the queue ahead, drained at the recent pace."""
        estimate = self._avg_run_s * (len(self._waiting) + 1) / self.max_running
        return int(min(60, max(1, math.ceil(estimate))))

    def _leave(self, ticket: Ticket) -> None:
        if ticket in self._waiting:
            self._waiting.remove(ticket)
            if not ticket.future.done():
                ticket.future.cancel()
            self._wake_quiet()
            self._kick()

    def _release(self, slot: Slot) -> None:
        kind = slot.ticket.kind
        self._running[kind] = max(0, self._running[kind] - 1)
        if kind == BATCH and slot in self._batch_slots:
            self._batch_slots.remove(slot)
        if self.fleet is not None and kind != BATCH:
            self.fleet.released(kind == REASONING)
        run_s = time.monotonic() - slot.started_at
        self._avg_run_s = 0.8 * self._avg_run_s + 0.2 * run_s
        if slot.ran:  # it really ran (a slot handed back before starting says nothing of the pace)
            self._run_times.append(run_s)
        self._kick()

    def _kick(self) -> None:
        if self._waiting:
            self._dispatch()

    # -- choosing ---------------------------------------------------------------------
    def _eligible(self, t: Ticket) -> bool:
        if t.kind == BATCH:
            return not self.interactive_waiting() and self._running[BATCH] < self.batch_slots()
        return t.kind != REASONING or self.reasoning_running() < self.reasoning_slots()

    def _order(self, arriving: Ticket | None = None) -> list[Ticket]:
        """Waiting tickets (and `arriving`, as if it had joined) in the order they would be admitted if
        room appeared for all."""
        candidates = self._waiting if arriving is None else [*self._waiting, arriving]
        eligible = [t for t in candidates if self._eligible(t)]
        # Batch after every interactive tier, whatever its own tier; within a tier, the nearest deadline first.
        by_priority = sorted(eligible, key=lambda t: (t.kind == BATCH, -t.tier.priority, t.deadline, t.seq))
        starved = self._starved_tier([t for t in eligible if t.kind != BATCH])
        if starved is None:
            return by_priority
        first = min((t for t in eligible if t.tier.name == starved), key=lambda t: (t.deadline, t.seq))
        return [first] + [t for t in by_priority if t is not first]

    def _starved_tier(self, eligible: list[Ticket]) -> str | None:
        """The waiting tier furthest below its reserved share of recent admissions, if any."""
        recent = self.fleet.recent if self.fleet is not None else self._recent
        if not recent:
            return None
        best, best_gap = None, 0.0
        for name in {t.tier.name for t in eligible}:
            share = next(t.tier.reserved_share for t in eligible if t.tier.name == name)
            gap = share - sum(1 for n in recent if n == name) / len(recent)
            if gap > best_gap:
                best, best_gap = name, gap
        return best

    def _dispatch(self) -> None:
        while self._waiting and self.running < self.max_running:
            order = self._order()
            if not order:
                break
            ticket = order[0]
            # The head waits for room rather than letting smaller requests overtake it forever.
            if not self.has_room(ticket.prompt_tokens + self._pending_tokens):
                break
            self._grant(ticket)
        if self._batch_slots and self.interactive_waiting():
            self._make_way()
        if self._waiting and self._announcer is None:
            # Positions may have moved; one announcement at a time (keeping a reference so it is not collected).
            self._announcer = asyncio.get_running_loop().create_task(self._announce())
            self._announcer.add_done_callback(lambda _t: setattr(self, "_announcer", None))

    def _grant(self, ticket: Ticket) -> None:
        self._waiting.remove(ticket)
        self._running[ticket.kind] += 1
        self._pending_tokens += ticket.prompt_tokens
        if ticket.kind != BATCH:
            self._recent.append(ticket.tier.name)
        if self.fleet is not None and ticket.kind != BATCH:
            self.fleet.granted(ticket.tier.name, ticket.kind == REASONING)
        slot = Slot(self, ticket, time.monotonic() - ticket.enqueued)
        if ticket.kind == BATCH:
            self._batch_slots.append(slot)
        else:
            self._starting += 1
        if ticket.future.done():  # cancelled meanwhile
            slot.release()
        else:
            ticket.future.set_result(slot)

    def _make_way(self) -> None:
        """An interactive request waits while batch requests run: ask the newest batch request to give way,
        unless one is already giving way (its slot comes back within an engine step)."""
        if any(s.yielding for s in self._batch_slots) or time.monotonic() - self._last_yield < YIELD_INTERVAL_S:
            return
        for slot in reversed(self._batch_slots):
            if slot.on_yield is not None:
                slot.yielding = True
                self._last_yield = time.monotonic()
                slot.on_yield()
                return

    async def _announce(self) -> None:
        """Tell each waiter its (1-based) place when it changes."""
        for position, ticket in enumerate(self._order() + [t for t in self._waiting if not self._eligible(t)], 1):
            if ticket.position != position and ticket.on_position is not None:
                ticket.position = position
                try:
                    await ticket.on_position(position)
                except Exception:  # a reader-side problem must not stall the queue
                    pass

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        # KV blocks free up inside the engine without telling us; look again every few ms while anyone waits.
        while self._waiting:
            await asyncio.sleep(self.poll_s)
            self._dispatch()
