"""Service tiers: what each plan may spend (tokens per minute and per day, concurrent answers,
the largest answer, which models) and where its requests stand in the admission queue.

Built-in defaults, overridden by a TOML file (`tiers_file` setting or CHATLOOM_TIERS_FILE) and then
by environment variables named CHATLOOM_TIER_<NAME>_<FIELD>, e.g. CHATLOOM_TIER_FREE_TOKENS_PER_DAY=50000.
"""
from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass
from typing import Mapping

ENV_FILE = "CHATLOOM_TIERS_FILE"
ENV_PREFIX = "CHATLOOM_TIER_"


@dataclass(frozen=True)
class Tier:
    name: str
    tokens_per_minute: int
    tokens_per_day: int
    requests_per_minute: int
    max_concurrent: int  # generations running at once, per user
    priority: int  # higher is served first by the admission queue
    # The share of admissions this tier keeps under load even when higher tiers are waiting,
    # so it slows down but never starves.
    reserved_share: float
    max_tokens: int  # cap on one answer's max_tokens
    models: tuple[str, ...] | None = None  # None: every model
    # Retrieval uploads: the largest file and the most bytes of files kept. None: the [files] settings,
    # which stay the ceiling (the edge refuses bigger bodies before a tier is known).
    max_file_bytes: int | None = None
    max_storage_bytes: int | None = None

    def allows_model(self, model: str) -> bool:
        return self.models is None or model in self.models


DEFAULT_TIERS: dict[str, Tier] = {
    "free": Tier("free", tokens_per_minute=20_000, tokens_per_day=200_000, requests_per_minute=60,
                 max_concurrent=2, priority=0, reserved_share=0.2, max_tokens=1024),
    "plus": Tier("plus", tokens_per_minute=100_000, tokens_per_day=2_000_000, requests_per_minute=300,
                 max_concurrent=4, priority=1, reserved_share=0.0, max_tokens=4096),
    "pro": Tier("pro", tokens_per_minute=500_000, tokens_per_day=20_000_000, requests_per_minute=1200,
                max_concurrent=16, priority=2, reserved_share=0.0, max_tokens=4096),
}

_FIELDS = {f.name: f for f in dataclasses.fields(Tier)}


def _coerce(name: str, field: str, value: object) -> object:
    if field not in _FIELDS or field == "name":
        raise ValueError(f"tier {name!r}: unknown field {field!r}")
    if field == "models":
        if value is None or value == "*" or value == ["*"]:
            return None
        items = value.split(",") if isinstance(value, str) else list(value)  # type: ignore[arg-type]
        return tuple(str(m).strip() for m in items if str(m).strip())
    kind = float if field == "reserved_share" else int
    try:
        result = kind(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"tier {name!r}: {field} must be a number, got {value!r}") from None
    if result < 0 or (field == "reserved_share" and result > 1):
        raise ValueError(f"tier {name!r}: {field} out of range: {value!r}")
    return result


class TierTable:
    """The configured tiers, looked up by name; unknown names fall back to the default tier."""

    def __init__(self, tiers: Mapping[str, Tier], default: str = "free") -> None:
        if default not in tiers:
            raise ValueError(f"the default tier {default!r} is not configured")
        self.tiers = dict(tiers)
        self.default = default
        if sum(t.reserved_share for t in self.tiers.values()) > 0.9:
            raise ValueError("reserved shares of all tiers add up to more than 0.9")

    def __getitem__(self, name: str) -> Tier:
        return self.tiers[name]

    def __contains__(self, name: object) -> bool:
        return name in self.tiers

    def names(self) -> list[str]:
        return sorted(self.tiers, key=lambda n: self.tiers[n].priority)

    def for_user(self, tier_name: str | None) -> Tier:
        return self.tiers.get(tier_name or self.default) or self.tiers[self.default]

    @classmethod
    def load(cls, path: str | None = None, env: Mapping[str, str] | None = None,
             default: str = "free") -> "TierTable":
        env = os.environ if env is None else env
        raw: dict[str, dict] = {n: dataclasses.asdict(t) for n, t in DEFAULT_TIERS.items()}
        path = path or env.get(ENV_FILE)
        if path:
            with open(path, "rb") as f:
                data = tomllib.load(f)
            # Either top-level tables ([free], [pro]) or nested under [tiers.free].
            data = data.get("tiers", data)
            for name, fields in data.items():
                if not isinstance(fields, dict):
                    raise ValueError(f"{path}: tier {name!r} must be a table")
                base = raw.get(name, {**raw[default], "name": name})
                raw[name] = {**base, **{k: _coerce(name, k, v) for k, v in fields.items()}}
        for key, value in env.items():
            if not key.startswith(ENV_PREFIX):
                continue
            rest = key[len(ENV_PREFIX):].lower()
            name = next((n for n in sorted(raw, key=len, reverse=True) if rest.startswith(n + "_")), None)
            if name is None:
                continue
            field = rest[len(name) + 1:]
            raw[name][field] = _coerce(name, field, value)
        tiers = {n: Tier(**{**fields, "name": n}) for n, fields in raw.items()}
        return cls(tiers, default)
