"""`chatloom serve`'s fleet flags: --replica URL (repeated), --local-replicas N, --router-policy.

Replica URLs are checked before the port opens: when no replica of a model can serve (unreachable,
not an OpenAI-compatible server, another model), serve stops with one line saying so. Local replicas
are child processes that live and die with the gateway.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from typing import Iterator

from chatloom.argtypes import positive_int


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica", action="append", default=None, metavar="URL",
                   help="serve the model from this OpenAI-compatible replica (chatloom replica, vLLM, SGLang); "
                        "repeat for several. See also [[fleet.models]] in the settings file")
    p.add_argument("--local-replicas", type=positive_int, default=None, metavar="N",
                   help="start N `chatloom replica` processes of --model here and route over them")
    p.add_argument("--replica-threads", type=positive_int, default=1, metavar="T",
                   help="CPU threads per local replica (default 1)")
    p.add_argument("--router-policy", choices=("round_robin", "least_load", "prefix_aware"), default=None,
                   help="how the router places requests (default prefix_aware)")


@contextlib.contextmanager
def fleet_for_serve(settings, args: argparse.Namespace) -> Iterator[object]:
    """The settings to serve with: local replicas started, replica URLs probed."""
    import logging

    from chatloom.app.core.fleet_settings import parse_fleet

    # The router checks every replica each second; one httpx line per check would drown the log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    changes: dict = {}
    if args.router_policy:
        changes["fleet.router_policy"] = args.router_policy
    if args.replica:
        changes["fleet.replicas"] = list(args.replica)
    local = None
    if args.local_replicas:
        if args.replica or settings.fleet.models:
            raise ValueError("--local-replicas replaces --replica and [[fleet.models]]; give one of them")
        from chatloom.serving.local_fleet import LocalReplicas

        extra = ["--max-num-seqs", str(settings.engine.max_num_seqs),
                 "--max-num-batched-tokens", str(settings.engine.max_num_batched_tokens), "--dtype", settings.model.dtype,
                 "--kv-cache-dtype", settings.engine.kv_cache_dtype]
        if settings.engine.kv_cache_gb is not None:
            extra += ["--kv-cache-gb", str(settings.engine.kv_cache_gb)]
        if settings.engine.num_blocks:
            extra += ["--num-blocks", str(settings.engine.num_blocks)]
        local = LocalReplicas(settings.model.name, args.local_replicas, args.replica_threads, extra)
        print(f"chatloom: starting {args.local_replicas} local replicas of {settings.model.name}", file=sys.stderr)
        try:
            changes["fleet.replicas"] = local.start()
        except RuntimeError as exc:
            raise ValueError(str(exc)) from None
    settings = settings.with_values(changes)
    try:
        fleet = parse_fleet(settings.fleet.models, settings.fleet.replicas, settings.fleet.router_policy, settings.fleet.router_weights,
                            settings.model.name)
        asyncio.run(_probe(fleet))
        yield settings
    finally:
        if local is not None:
            local.stop()


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
