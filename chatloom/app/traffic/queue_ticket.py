"""A request's place in the admission queue (admission.py): its tier, kind and deadline."""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from chatloom.app.traffic.tiers import Tier

# The kinds of request the queue tells apart (and the traffic classes but for the tier).
INTERACTIVE = "interactive"
REASONING = "reasoning"
BATCH = "batch"


@dataclass(eq=False)
class Ticket:
    tier: Tier
    prompt_tokens: int
    kind: str = INTERACTIVE
    seq: int = 0
    enqueued: float = field(default_factory=time.monotonic)
    future: asyncio.Future | None = None
    position: int = 0
    on_position: Callable[[int], Awaitable[None]] | None = None
    deadline: float = math.inf  # when its class's TTFT target runs out (set by the queue)
