"""Pacing of Python's cyclic garbage collector in a serving process (a gateway, a replica).

A full collection walks every object the collector tracks, and nothing else in the process runs
meanwhile. A gateway that has imported the app and PyTorch tracks about 400,000 objects before its
first request, and each open stream adds about 450 more (coroutine frames, the HTTP client's state
for the replica's stream). With CPython's defaults a full collection comes each time the tracked
heap has grown by a quarter, so a burst of 1,000 new streams brings several, the last ones taking
200-540 ms on a 2-core machine, and every stream's tokens wait that long. So a serving process:

- **freezes what startup built** (`gc.freeze()`, after a collection): the permanent generation is
  never walked again. It is done again once the model has loaded, for what the load built;
- **collects the two younger generations on a clock** (`runtime.gc_young_interval_ms`, 30 ms), from
  a thread of its own. Python starts a young collection after 700 more allocations than
  deallocations, but deallocating an old object counts too, so while streams run (each token's
  objects freed as the next ones are made) the youngest generation grew to 10,000-40,000 objects
  and the middle one to 60,000, and collecting them stopped the process for 15-45 ms. On a clock
  each collection walks what 30 ms allocated: a few milliseconds at most, during a burst of new
  streams;
- **collects the oldest generation rarely**: after `runtime.gc_thresholds[2]` (2,000) collections of
  the middle one, about a minute at the clock's pace, and only once the long-lived heap has grown
  by a quarter (Python's own rule). A full collection walks every stream's objects: at 1,000 open
  streams, hundreds of milliseconds. Garbage cycles among long-lived objects wait longer for their
  memory.

`start()` is called by the commands that run a server (`chatloom serve`, `chatloom replica`), not by
the app, so an app built in a test or embedded in another server leaves its process's collector as
it was.
"""
from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Protocol

log = logging.getLogger(__name__)


class PacingSettings(Protocol):
    gc_freeze: bool
    gc_thresholds: list[int]
    gc_young_interval_ms: float


_paced: PacingSettings | None = None  # what start() was given
_stop: threading.Event | None = None  # set, it ends the clock's thread (stop())
PACER_THREAD = "chatloom-gc-pacer"


def start(settings: PacingSettings) -> None:
    """Pace this process's collector (the first call; later ones change nothing)."""
    global _paced, _stop
    if _paced is not None:
        return
    _paced = settings
    gc.set_threshold(*settings.gc_thresholds)
    if settings.gc_freeze:
        freeze()
    if settings.gc_young_interval_ms > 0:
        _stop = threading.Event()
        threading.Thread(target=_collect_young, args=(settings.gc_young_interval_ms / 1e3, _stop),
                         name=PACER_THREAD, daemon=True).start()


def stop() -> None:
    """End the clock's collections and forget start() (tests; a server's process just exits)."""
    global _paced, _stop
    if _stop is not None:
        _stop.set()
    _paced, _stop = None, None


def _collect_young(interval_s: float, stop: threading.Event) -> None:
    # A collection holds the interpreter lock, so it pauses the event loop's thread as one the
    # allocator starts would; it is only shorter.
    while not stop.wait(interval_s):
        gc.collect(1)


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
