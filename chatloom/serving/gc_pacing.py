"""Pacing of Python's cyclic garbage collector in a serving process (a gateway, a replica).

A full collection walks every object the collector tracks, and nothing else in the process runs
meanwhile. A gateway that has imported the app and PyTorch tracks about 400,000 objects before its
first request, and each open stream adds about 450 more (coroutine frames, the HTTP client's state
for the replica's stream). With CPython's defaults a full collection comes each time the tracked
heap has grown by a quarter, so a burst of 1,000 new streams brings several, the last ones taking
200-540 ms on a 2-core machine, and every stream's tokens wait that long. So a serving process:

- **freezes what startup built** (`gc.freeze()`, after a collection): the permanent generation is
  never walked again. It is done again once the model has loaded, for what the load built;
- **collects the oldest generation rarely**: after `runtime.gc_thresholds[2]` (100) collections of
  the middle one instead of Python's 10. 1,000 streams set up at once took about 40 middle
  collections, so such a burst no longer meets a full one. Garbage cycles among long-lived objects
  wait longer for their memory (at most the 700,000 net allocations between two full collections);
  the young generations are collected as before.

`start()` is called by the commands that run a server (`chatloom serve`, `chatloom replica`), not by
the app, so an app built in a test or embedded in another server leaves its process's collector as
it was.
"""
from __future__ import annotations

import gc
import logging
import time
from typing import Protocol

log = logging.getLogger(__name__)


class PacingSettings(Protocol):
    gc_freeze: bool
    gc_thresholds: list[int]


_paced: PacingSettings | None = None  # what start() was given


def start(settings: PacingSettings) -> None:
    """Pace this process's collector (the first call; later ones change nothing)."""
    global _paced
    if _paced is not None:
        return
    _paced = settings
    gc.set_threshold(*settings.gc_thresholds)
    if settings.gc_freeze:
        freeze()


def after_load() -> None:
    """Freeze what loading the model built, where `start()` paced this process with freezing on."""
    if _paced is not None and _paced.gc_freeze:
        freeze()


def freeze() -> None:
    """Collect what is garbage now, then move every tracked object to the permanent generation."""
    began = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.debug("froze %d objects in %.0f ms", gc.get_freeze_count(), (time.perf_counter() - began) * 1e3)
