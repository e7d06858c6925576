"""Degrade before refusing, in the app: the ladder (serving/degrade.py, shared with the fleet simulator)
and the steps applied to the request being handled.

Which steps applied to a request is in its `x-chatloom-degraded` header, and the level is on /metrics;
control.py applies the steps (effort cap, small model, shorter answers) to each request.
"""
from __future__ import annotations

from contextvars import ContextVar

from chatloom.serving.degrade import STEPS, DegradeLadder, RecentMax, Signals

__all__ = ["APPLIED", "STEPS", "DegradeLadder", "RecentMax", "Signals"]

# The steps applied to the request being handled; the HTTP middleware resets it per request and turns
# it into the x-chatloom-degraded header.
APPLIED: ContextVar[tuple[str, ...]] = ContextVar("degraded_steps", default=())
