"""Every request of a run as numpy columns, and the log that builds them as requests end.

A run of hundreds of thousands of requests cannot keep each one's token lists until the end (about
90 KB a request); the simulator writes a request's figures here when it ends and drops the rest.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np

REFUSED_CODES = ("", "queue_timeout", "no_replica", "longer_than_kv_pool")
_NAN = float("nan")


@dataclass
class RequestTable:
    """Every request of a run as numpy columns (cheap to send between processes and to summarize).
    Times in seconds; NaN where the event never happened."""

    arrival: np.ndarray
    first_scheduled: np.ndarray
    first_token: np.ndarray
    finished: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    cached_tokens: np.ndarray
    preemptions: np.ndarray
    priority: np.ndarray
    reasoning: np.ndarray
    refused: np.ndarray  # index into REFUSED_CODES; 0: not refused

    @classmethod
    def from_requests(cls, reqs) -> "RequestTable":
        log = RequestLog()
        for r in reqs:
            log.add(r)
        return log.table()

    @classmethod
    def concat(cls, tables: list["RequestTable"]) -> "RequestTable":
        fields = cls.__dataclass_fields__
        return cls(**{f: np.concatenate([getattr(t, f) for t in tables]) for f in fields})

    def __len__(self) -> int:
        return len(self.arrival)


_FLOATS = ("arrival", "first_scheduled", "first_token", "finished")
_INTS = ("prompt_tokens", "output_tokens", "cached_tokens", "preemptions", "priority", "reasoning", "refused")


class RequestLog:
    """A RequestTable built one request at a time, in typed arrays (8 bytes a figure)."""

    def __init__(self) -> None:
        self._cols = {f: array("d") for f in _FLOATS} | {f: array("q") for f in _INTS}

    def add(self, r) -> None:
        """Record a SimRequest's figures (its own token lists are not kept)."""
        c = self._cols
        c["arrival"].append(r.arrival)
        c["first_scheduled"].append(_NAN if r.first_scheduled is None else r.first_scheduled)
        c["first_token"].append(_NAN if r.first_token is None else r.first_token)
        c["finished"].append(_NAN if r.finished is None else r.finished)
        c["prompt_tokens"].append(len(r.prompt))
        c["output_tokens"].append(len(r.answer))
        c["cached_tokens"].append(r.cached_tokens)
        c["preemptions"].append(r.preemptions)
        c["priority"].append(r.priority)
        c["reasoning"].append(int(r.reasoning))
        c["refused"].append(REFUSED_CODES.index(r.refused or ""))

    def __len__(self) -> int:
        return len(self._cols["arrival"])

    def table(self) -> RequestTable:
        c = self._cols
        cols = {f: np.frombuffer(c[f], dtype=np.float64).copy() for f in _FLOATS}
        cols |= {f: np.frombuffer(c[f], dtype=np.int64).copy() for f in _INTS}
        cols["reasoning"] = cols["reasoning"].astype(bool)
        return RequestTable(**cols)
