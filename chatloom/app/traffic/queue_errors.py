"""The admission queue's refusals: a request that waited too long, or one refused on arrival."""
from __future__ import annotations


class QueueTimeout(Exception):
    code = "queue_timeout"

    def __init__(self, waited_s: float, retry_after: int, message: str | None = None) -> None:
        super().__init__(message or f"the server is busy: no room for this request after {waited_s:.0f} s in "
                         f"the queue; retry in {retry_after} s")
        self.waited_s = waited_s
        self.retry_after = retry_after


class QueueFull(QueueTimeout):
    """Refused on arrival: at the measured pace the request would not get in before max_wait_s."""

    code = "queue_full"

    def __init__(self, expected_wait_s: float, max_wait_s: float, retry_after: int) -> None:
        super().__init__(0.0, retry_after, f"the server is busy: this request would wait about "
                         f"{expected_wait_s:.0f} s for room (at most {max_wait_s:.0f} s allowed); retry in "
                         f"{retry_after} s")
        self.expected_wait_s = expected_wait_s
