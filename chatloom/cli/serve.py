"""`chatloom serve` and `chatloom keys create`: the product's commands.

Imports of the app (FastAPI, SQLAlchemy, torch) happen inside the handlers, so registering
these commands costs nothing for the others.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING

from chatloom.argtypes import positive_float, positive_int
from chatloom.model_args import add_kv_cache_dtype_arg, add_model_args

if TYPE_CHECKING:
    from chatloom.settings import Settings


def _settings(args: argparse.Namespace):
    from chatloom.settings import load_settings

    return load_settings(args.config, flags={key: getattr(args, flag, None) for flag, key in SETTING_FLAGS.items()})


# The flags these commands take, and the setting each one sets (over the file and the environment).
SETTING_FLAGS = {"db": "server.db_url", "redis": "shared_state.redis_url", "host": "server.host",
                 "port": "server.port", "model": "model.name", "dtype": "model.dtype",
                 "int8_matmul": "model.int8_matmul", "mmproj": "model.mmproj", "speech_model": "speech.model",
                 "kv_cache_gb": "engine.kv_cache_gb",
                 "num_blocks": "engine.num_blocks", "max_num_seqs": "engine.max_num_seqs",
                 "max_num_batched_tokens": "engine.max_num_batched_tokens", "kv_cache_dtype": "engine.kv_cache_dtype",
                 "speculative": "engine.speculative", "num_speculative_tokens": "engine.num_speculative_tokens",
                 "speculative_model": "engine.speculative_model", "min_replicas": "autoscale.min_replicas",
                 "max_replicas": "autoscale.max_replicas", "replica_capacity_rps": "autoscale.capacity_rps"}


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML file of settings (see the configuration reference)")
    p.add_argument("--db", metavar="URL", help="database URL (default: SQLite at ./data/chatloom.db; "
                                               "postgresql+asyncpg://... for PostgreSQL)")


def check_model_kinds(settings: Settings) -> None:
    """Refuse, before anything starts, a Whisper folder given as the chat model and a speech model that is
    not a Whisper folder: the speech model would otherwise fail only at its first request."""
    from pathlib import Path

    from chatloom.models.speech.whisper import is_whisper_folder

    if settings.model.name and is_whisper_folder(Path(settings.model.name)):
        raise ValueError(f"{settings.model.name} is a Whisper speech model, not a chat model: "
                         f"serve it with --speech-model (or [speech] model)")
    speech = settings.speech.model
    if speech is None:
        return
    if not Path(speech).exists():
        raise ValueError(f"speech model not found: {speech}")
    if not is_whisper_folder(Path(speech)):
        raise ValueError(f"speech model {speech} is not a Whisper folder "
                         f"(a Hugging Face folder whose config.json has model_type whisper)")


def cmd_serve(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from chatloom.app import http_server
    from chatloom.app.main import create_app

    from chatloom.cli.fleet import fleet_for_serve
    from chatloom.serving import gc_pacing

    settings = _settings(args)
    check_model_kinds(settings)
    tls = (args.tls_cert, args.tls_key)
    if any(tls) and not all(tls):
        raise ValueError("--tls-cert and --tls-key go together (HTTP/2 needs both)")
    for path in filter(None, tls):
        if not Path(path).is_file():
            raise ValueError(f"no such file: {path}")
    logging.basicConfig(level=settings.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with fleet_for_serve(settings, args) as (settings, local):  # replicas started/probed; a bad one is one line
        app = create_app(settings, local_replicas=local)
        app.state.ctx.backend.check()  # a missing model file or unsupported architecture: one line, exit 2
        gc_pacing.start(settings.runtime)  # what startup built is never walked again (serving/gc_pacing.py)
        scheme = "https (HTTP/2)" if all(tls) else "http"
        shared = f", shared state in Redis at {settings.shared_state.redis_url}" if settings.shared_state.redis_url else ""
        print(f"chatloom: serving {settings.model.name} on {scheme}://{settings.server.host}:{settings.server.port} "
              f"(database {settings.database_url}{shared})", file=sys.stderr)
        if all(tls):  # HTTP/2 over TLS (Hypercorn)
            http_server.run(app, settings, *tls)
        else:  # uvicorn, noting when SIGTERM came so the drain deadline counts from it
            import uvicorn

            server = _Server(app, uvicorn.Config(app, host=settings.server.host, port=settings.server.port,
                                                 log_level=settings.server.log_level,
                                                 timeout_graceful_shutdown=2 if settings.shared_state.redis_url  # clients resume elsewhere
                                                 else max(1, round(settings.recovery.shutdown_drain_s))))
            app.state.stop_server = lambda: setattr(server, "should_exit", True)
            server.run()
    failure = getattr(app.state, "startup_failure", None)
    if failure is not None:  # the model could not load: the process ends, saying why (chatloom.cli prints it)
        from chatloom.models import ModelError

        raise ModelError(failure)
    return 0


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn that notes when SIGTERM/SIGINT came, so the app's drain deadline counts from then."""

        def __init__(self, app, config) -> None:
            super().__init__(config)
            self._app = app

        def handle_exit(self, sig, frame) -> None:
            import time
            if getattr(self._app.state, "shutdown_started", None) is None:
                self._app.state.shutdown_started = time.monotonic()
            super().handle_exit(sig, frame)

    return Server


def _Server(app, config):
    return _server_class()(app, config)


async def _create_key(settings, username: str, name: str, create_user: bool) -> str:
    from chatloom.app.core.auth import new_api_key
    from chatloom.store import ApiKeys, Database, Users

    db = Database(settings.database_url)
    try:
        await db.migrate()
        async with db.session() as session:
            users = Users(session)
            user = await users.by_username(username)
            if user is None:
                if not create_user:
                    raise ValueError(f"no user named {username!r} (sign up first, or pass --create-user)")
                user = await users.create(username, None, is_admin=await users.count() == 0)
            key, prefix, key_hash = new_api_key()
            await ApiKeys(session).create(user.id, name, prefix, key_hash)
            await session.commit()
            return key
    finally:
        await db.close()


def cmd_keys_create(args: argparse.Namespace) -> int:
    key = asyncio.run(_create_key(_settings(args), args.user, args.name, args.create_user))
    print(key)
    return 0


async def _set_tier(settings, username: str, tier: str) -> None:
    from chatloom.app.traffic.tiers import TierTable
    from chatloom.store import Database, Users

    tiers = TierTable.load(settings.traffic.tiers_file, default=settings.traffic.default_tier)
    if tier not in tiers:
        raise ValueError(f"unknown tier {tier!r}; configured: {', '.join(tiers.names())}")
    db = Database(settings.database_url)
    try:
        await db.migrate()
        async with db.session() as session:
            if await Users(session).set_tier(username, tier) is None:
                raise ValueError(f"no user named {username!r}")
            await session.commit()
    finally:
        await db.close()


def cmd_users_set_tier(args: argparse.Namespace) -> int:
    asyncio.run(_set_tier(_settings(args), args.user, args.tier))
    print(f"{args.user}: tier {args.tier}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the product's commands to the top-level parser."""
    p = subparsers.add_parser("serve", help="run the chat service (REST/SSE, OpenAI-compatible API)")
    p.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000)")
    add_model_args(p, from_settings=True)
    p.add_argument("--speech-model", default=None, metavar="PATH",
                   help="a Whisper Hugging Face folder for speech to text (POST /v1/audio/transcriptions)")
    # Engine sizing: the defaults are the engine's own (chatloom/engine/config.py), not repeated here.
    p.add_argument("--kv-cache-gb", type=positive_float, default=None, help="KV pool size in GiB")
    p.add_argument("--num-blocks", type=positive_int, default=None, help="KV pool size in blocks (overrides GiB)")
    p.add_argument("--max-num-seqs", type=positive_int, default=None, help="sequences per engine step")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None, help="token budget per engine step")
    add_kv_cache_dtype_arg(p)
    p.add_argument("--speculative", choices=["off", "ngram", "draft"], default=None,
                   help="speculative decoding: ngram (prompt lookup) or draft (--speculative-model); default off")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=None,
                   help="most tokens proposed per sequence and step (default 4; fewer when it does not pay)")
    p.add_argument("--speculative-model", default=None, metavar="ID|PATH|self-int8|self-layers:N",
                   help="the draft model for --speculative draft (same tokenizer as --model)")
    from chatloom.cli.fleet import add_fleet_args

    add_fleet_args(p)
    p.add_argument("--redis", metavar="URL", help="share quotas, streams, stops and jobs with other gateways "
                                                  "through this Redis (redis://host:port/0)")
    p.add_argument("--tls-cert", metavar="FILE", help="serve HTTPS with HTTP/2 (Hypercorn): certificate (PEM)")
    p.add_argument("--tls-key", metavar="FILE", help="the certificate's private key (PEM)")
    _add_common(p)
    p.set_defaults(func=cmd_serve)

    keys = subparsers.add_parser("keys", help="manage API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", metavar="SUBCOMMAND")
    k = keys_sub.add_parser("create", help="create an API key for a user and print it (shown once)")
    k.add_argument("--user", required=True, metavar="NAME", help="the account the key acts for")
    k.add_argument("--name", default="", help="a label to tell keys apart")
    k.add_argument("--create-user", action="store_true",
                   help="create the account (without a password) if it does not exist")
    _add_common(k)
    k.set_defaults(func=cmd_keys_create)

    users = subparsers.add_parser("users", help="manage accounts")
    users_sub = users.add_subparsers(dest="users_command", metavar="SUBCOMMAND")
    t = users_sub.add_parser("set-tier", help="put a user on a tier (free, plus, pro, or one from the tiers file)")
    t.add_argument("user", metavar="USER")
    t.add_argument("tier", metavar="TIER")
    _add_common(t)
    t.set_defaults(func=cmd_users_set_tier)
