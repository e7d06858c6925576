"""The `[[fleet.models]]` setting: which models the service offers and where each one runs.

    router_policy = "prefix_aware"            # round_robin | least_load | prefix_aware
    router_weights = { prefix = 1.0, kv_usage = 0.5, waiting = 0.25, min_prefix_fraction = 0.1 }

    [[fleet.models]]                                # served by replicas (chatloom replica, vLLM, SGLang)
    id = "smollm2-135m-instruct"
    replicas = ["http://10.0.0.5:8100", "http://10.0.0.6:8100"]
    tokenizer = "smollm2-135m-instruct"       # optional: a registry id or model file to tokenize with here

    [[fleet.models]]                                # served in this process
    id = "tiny-random"
    path = "tiny-random"                      # optional: registry id, GGUF file or HF folder (default: id)

`chatloom serve --replica URL` (repeated) is the simple case: the default model on those replicas.
A malformed setting is a ValueError of one line naming the entry and the field; the CLI prints it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields

from chatloom.serving.backend import Backend
from chatloom.serving.routing import PolicyWeights

log = logging.getLogger(__name__)
_ENTRY_KEYS = {"id", "replicas", "path", "tokenizer", "api_key", "pooling"}


@dataclass(frozen=True)
class ModelEntry:
    id: str
    replicas: tuple[str, ...] = ()  # empty: run in this process
    path: str | None = None  # the local model spec (default: id)
    tokenizer: str | None = None  # where a router reads its tokenizer (default: id or path, if local)
    api_key: str | None = None  # sent to the replicas (vLLM --api-key)
    pooling: str | None = None  # embeddings of a model run here: "mean" or "last" (default: embeddings.pooling)


@dataclass(frozen=True)
class FleetSettings:
    models: tuple[ModelEntry, ...] = ()
    policy: str = "prefix_aware"
    weights: PolicyWeights = field(default_factory=PolicyWeights)
    class_targets: bool = False  # routers place by what the class's TTFT target leaves (serving/routing.py)
    opening_limit: int = 2  # requests a router places at once (serving/opening_gate.py)
    opening_hold_s: float = 0.05


def parse_fleet(models: object, replicas: object = None, policy: object = "prefix_aware",
                weights: object = None, default_model: str = "", class_targets: bool = False,
                opening_limit: int = 2, opening_hold_s: float = 0.05) -> FleetSettings:
    """Check and normalize the raw settings; ValueError says exactly what is wrong."""
    from chatloom.serving.policies import POLICIES

    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"router_policy: {policy!r} is not one of {', '.join(POLICIES)}")
    entries: list[ModelEntry] = []
    if models is not None:
        if not isinstance(models, list) or not models:
            raise ValueError("fleet.models: expected one or more [[fleet.models]] tables")
        for i, raw in enumerate(models):
            entries.append(_entry(i, raw))
    if replicas:
        if not isinstance(replicas, list) or not all(isinstance(u, str) for u in replicas):
            raise ValueError("replicas: expected a list of URLs")
        if entries:
            raise ValueError("give replica URLs either with --replica / fleet.replicas or inside [[fleet.models]], not both")
        entries.append(_entry(0, {"id": _served_id(default_model), "path": default_model, "replicas": replicas}))
    ids = [e.id for e in entries]
    dupes = sorted({m for m in ids if ids.count(m) > 1})
    if dupes:
        raise ValueError(f"fleet.models: {', '.join(dupes)} listed twice")
    return FleetSettings(tuple(entries), policy, _weights(weights), class_targets, opening_limit,
                         opening_hold_s)


def fleet_from_settings(settings) -> FleetSettings:
    """parse_fleet over the settings tree's `fleet` group and default model (serve and the fleet CLI)."""
    f = settings.fleet
    return parse_fleet(f.models, f.replicas, f.router_policy, f.router_weights, settings.model.name,
                       f.router_class_targets, f.router_opening_limit, f.router_opening_hold_ms / 1000)


def _served_id(spec: str) -> str:
    from chatloom.serving.local import model_id_for

    return model_id_for(spec)


def _entry(i: int, raw: object) -> ModelEntry:
    where = f"fleet.models[{i}]"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a table with an id")
    unknown = sorted(set(raw) - _ENTRY_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(_ENTRY_KEYS))})")
    model_id = raw.get("id")
    if not isinstance(model_id, str) or not model_id.strip():
        raise ValueError(f"{where}: id must be a non-empty string")
    reps = raw.get("replicas", [])
    if not isinstance(reps, list) or not all(isinstance(u, str) for u in reps):
        raise ValueError(f"{where} ({model_id}): replicas must be a list of URLs")
    for url in reps:
        if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
            raise ValueError(f"{where} ({model_id}): replica URL {url!r} must look like http://host:port")
    for key in ("path", "tokenizer", "api_key"):
        if key in raw and not isinstance(raw[key], str):
            raise ValueError(f"{where} ({model_id}): {key} must be a string")
    pooling = raw.get("pooling")
    if pooling is not None and pooling not in ("mean", "last"):
        raise ValueError(f"{where} ({model_id}): pooling must be \"mean\" or \"last\"")
    return ModelEntry(model_id, tuple(u.rstrip("/") for u in reps), raw.get("path"), raw.get("tokenizer"),
                      raw.get("api_key"), pooling)


def _weights(raw: object) -> PolicyWeights:
    if raw is None:
        return PolicyWeights()
    if not isinstance(raw, dict):
        raise ValueError("router_weights: expected a table such as { prefix = 1.0, kv_usage = 0.5 }")
    known = {f.name for f in fields(PolicyWeights)} - {"extra"}
    values, extra = {}, {}
    for key, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"router_weights.{key}: expected a number >= 0")
        (values if key in known else extra)[key] = float(value)
    return PolicyWeights(**values, extra=extra)


def _router_tokenizer(entry: ModelEntry):
    """The tokenizer a router uses here, when the model's files are at hand (None: ask the replicas)."""
    from chatloom.models import ModelError, load_tokenizer

    spec = entry.tokenizer or entry.path or entry.id
    try:
        return load_tokenizer(spec)
    except (ModelError, OSError, ValueError) as exc:
        if entry.tokenizer:
            raise ValueError(f"model {entry.id}: tokenizer {entry.tokenizer!r}: {exc}") from None
        log.info("model %s: no local tokenizer (%s); the replicas tokenize", entry.id, exc)
        return None


def build_fleet_backend(fleet: FleetSettings, local_backend) -> Backend:
    """One backend for every configured model. `local_backend(spec, pooling)` builds an in-process one."""
    from chatloom.serving.multi_model import MultiModelBackend
    from chatloom.serving.router import Router, RouterConfig

    backends: dict[str, Backend] = {}
    for e in fleet.models:
        if e.replicas:
            config = RouterConfig(policy=fleet.policy, weights=fleet.weights, class_targets=fleet.class_targets,
                                  opening_limit=fleet.opening_limit, opening_hold_s=fleet.opening_hold_s)
            backends[e.id] = Router(e.id, list(e.replicas), config, _router_tokenizer(e), e.api_key)
        else:
            backends[e.id] = local_backend(e.path or e.id, e.pooling)
    if len(backends) == 1:
        return next(iter(backends.values()))
    return MultiModelBackend(backends)
