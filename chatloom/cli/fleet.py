"""`chatloom serve`'s fleet flags: --replica URL (repeated), --local-replicas N, --router-policy.

Replica URLs are checked before the port opens: when no replica of a model can serve (unreachable,
not an OpenAI-compatible server, another model), serve stops with one line saying so. Local replicas
are child processes that live and die with the gateway; they serve --model, the default model, beside
any other models [[fleet.models]] lists (a smaller one for the degrade ladder, say).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from typing import Iterator

from chatloom.argtypes import positive_float, positive_int


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica", action="append", default=None, metavar="URL",
                   help="serve the model from this OpenAI-compatible replica (chatloom replica, vLLM, SGLang); "
                        "repeat for several. See also [[fleet.models]] in the settings file")
    p.add_argument("--local-replicas", type=_count_or_auto, default=None, metavar="N|auto",
                   help="start N `chatloom replica` processes of --model here and route over them (the "
                        "default model; [[fleet.models]] may add others); 'auto': start --min-replicas and let "
                        "the predictive autoscaler start and drain more")
    p.add_argument("--min-replicas", type=positive_int, default=None, metavar="N",
                   help="with --local-replicas auto: fewest replicas (autoscale.min_replicas)")
    p.add_argument("--max-replicas", type=positive_int, default=None, metavar="N",
                   help="with --local-replicas auto: most replicas (autoscale.max_replicas)")
    p.add_argument("--replica-capacity-rps", type=positive_float, default=None, metavar="R",
                   help="requests per second one replica serves within its SLO (autoscale.capacity_rps)")
    p.add_argument("--replica-threads", type=positive_int, default=1, metavar="T",
                   help="CPU threads per local replica (default 1)")
    p.add_argument("--router-policy", choices=("round_robin", "least_load", "prefix_aware"), default=None,
                   help="how the router places requests (default prefix_aware)")


def _count_or_auto(text: str) -> int | str:
    return "auto" if text == "auto" else positive_int(text)


@contextlib.contextmanager
def fleet_for_serve(settings, args: argparse.Namespace) -> Iterator[tuple[object, object]]:
    """(The settings to serve with, the local replicas or None): local replicas started, replica URLs
    probed."""
    import logging

    from chatloom.app.core.fleet_settings import fleet_from_settings

    # The router checks every replica each second; one httpx line per check would drown the log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    changes: dict = {}
    if args.router_policy:
        changes["fleet.router_policy"] = args.router_policy
    if args.replica:
        changes["fleet.replicas"] = list(args.replica)
    local = None
    if args.local_replicas:
        if args.replica or settings.fleet.replicas:
            raise ValueError("--local-replicas replaces --replica and fleet.replicas; give one of them")
        from chatloom.serving.local_fleet import LocalReplicas

        served = _local_model_id(settings)

        extra = replica_args(settings)
        auto = args.local_replicas == "auto"
        if auto:
            changes["autoscale.enabled"] = True
            settings = settings.with_values({"autoscale.enabled": True})  # one line if capacity_rps is missing
        count = settings.autoscale.min_replicas if auto else args.local_replicas
        local = LocalReplicas(settings.model.name, count, args.replica_threads, extra)
        print(f"chatloom: starting {count} local replicas of {settings.model.name}"
              f"{' (autoscaled)' if auto else ''}", file=sys.stderr)
        started = time.monotonic()
        try:
            urls = local.start()
        except RuntimeError as exc:
            raise ValueError(str(exc)) from None
        if settings.fleet.models:  # the local replicas' model comes first (the default), then the others
            changes["fleet.models"] = [{"id": served, "path": settings.model.name, "replicas": urls},
                                       *settings.fleet.models]
        else:
            changes["fleet.replicas"] = urls
        if auto and settings.autoscale.startup_s is None:  # the replicas started side by side: one start-up
            changes["autoscale.startup_s"] = round(time.monotonic() - started, 1)
    settings = settings.with_values(changes)
    try:
        fleet = fleet_from_settings(settings)
        asyncio.run(_probe(fleet))
        yield settings, local
    finally:
        if local is not None:
            local.stop()


def _local_model_id(settings) -> str:
    """The id the local replicas serve `model.name` under; ValueError if a [[fleet.models]] entry has it too."""
    from chatloom.serving.local import model_id_for

    served = model_id_for(settings.model.name)
    if any(isinstance(m, dict) and m.get("id") == served for m in settings.fleet.models or []):
        raise ValueError(f"[[fleet.models]] lists {served!r}, the model the local replicas serve; "
                         "give the other models there and this one with --model")
    return served


def replica_args(settings) -> list[str]:
    """The `chatloom replica` flags that give each local replica the gateway's own model and engine
    settings (the model itself is LocalReplicas' first argument)."""
    from pathlib import Path

    extra = ["--max-num-seqs", str(settings.engine.max_num_seqs),
             "--max-num-batched-tokens", str(settings.engine.max_num_batched_tokens), "--dtype", settings.model.dtype,
             "--kv-cache-dtype", settings.engine.kv_cache_dtype]
    if settings.engine.kv_cache_gb is not None:
        extra += ["--kv-cache-gb", str(settings.engine.kv_cache_gb)]
    if settings.engine.num_blocks:
        extra += ["--num-blocks", str(settings.engine.num_blocks)]
    if settings.model.mmproj:  # a GGUF decoder's image side: without it a replica would take no images
        extra += ["--mmproj", str(Path(settings.model.mmproj).expanduser().resolve())]
    extra += ["--encoder-cache-mb", str(settings.engine.encoder_cache_mb),
              "--encoder-max-slowdown", str(settings.engine.encoder_max_slowdown)]
    # Both ways: the gateway's file may turn a switch off that a replica's environment would turn on.
    if settings.model.int8_matmul is not None:
        extra.append("--int8-matmul" if settings.model.int8_matmul else "--no-int8-matmul")
    extra.append("--bf16-matmul" if settings.model.bf16_matmul else "--no-bf16-matmul")
    return extra


async def _probe(fleet) -> None:
    """Every remote model must have at least one replica that serves it; else one line and exit."""
    from chatloom.serving.backend import BackendNotReady
    from chatloom.serving.router import Router, RouterConfig

    for entry in fleet.models:
        if not entry.replicas:
            continue
        router = Router(entry.id, list(entry.replicas), RouterConfig(policy=fleet.policy), api_key=entry.api_key)
        try:
            await router.start()
        except BackendNotReady as exc:
            raise ValueError(str(exc)) from None
        finally:
            await router.close()
