"""The application factory: wires settings, database, backend and routes into a FastAPI app."""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI

from chatloom.app.core.auth import Passwords, Tokens
from chatloom.app.core.caller_cache import CallerCache
from chatloom.app.chat.conversation_service import ConversationService
from chatloom.app.api.deps import AppContext
from chatloom.app.api.error_handlers import install_error_handlers
from chatloom.app.state.hot_state import build_hot_state, install_redis_errors, start_hot_state
from chatloom.app.api import openapi_responses
from chatloom.app.generation.pipeline import Pipeline
from chatloom.app.chat.recovery import Sweeper, drain
from chatloom.app.api.routes import (admin, anthropic, auth, conversations, health, memory, moderations, openai,
                                     portability, recovery, responses, sharing, sso, usage, web)
from chatloom.settings import Settings
from chatloom.app.traffic.control import RateLimitHeaders, build_traffic
from chatloom.app.core.validation import EdgeGuard
from chatloom.engine import EngineConfig
from chatloom.serving import Backend, BackendError, LocalBackend, ModelLoadFailed
from chatloom.store import Database
from chatloom.store.blobs import LocalBlobStore

log = logging.getLogger(__name__)


def default_backend(settings: Settings) -> Backend:
    if settings.fleet.models or settings.fleet.replicas:  # several models, or replicas: the fleet
        from chatloom.app.core.fleet_settings import build_fleet_backend, parse_fleet

        fleet = parse_fleet(settings.fleet.models, settings.fleet.replicas, settings.fleet.router_policy, settings.fleet.router_weights,
                            settings.model.name)
        return build_fleet_backend(fleet, lambda spec: local_backend(settings, spec))
    return local_backend(settings, settings.model.name)


def local_backend(settings: Settings, spec: str) -> Backend:
    return LocalBackend(spec, settings.model.dtype, EngineConfig.from_settings(settings.engine),
                        int8_matmul=settings.model.int8_matmul, bf16_matmul=settings.model.bf16_matmul)


def create_app(settings: Settings | None = None, backend: Backend | None = None) -> FastAPI:
    """Build the app. Without a backend, the settings' model runs in-process (and is closed with the app);
    a backend passed in belongs to the caller."""
    settings = settings or Settings()
    owns_backend = backend is None
    backend = backend or default_backend(settings)
    db = Database(settings.database_url)
    hot = build_hot_state(settings)  # quotas, stream logs, stops, job leases: in memory, or shared in Redis
    traffic = build_traffic(settings, backend, db)
    traffic.quotas = hot.quotas
    traffic.admission.fleet = hot.fleet
    pipeline = Pipeline(backend, traffic, settings)
    ctx = AppContext(
        settings=settings, db=db, backend=backend,
        passwords=Passwords(settings.accounts.argon2_time_cost, settings.accounts.argon2_memory_kib),
        tokens=Tokens(settings.secret(), settings.accounts.token_ttl_s), traffic=traffic, pipeline=pipeline,
        conversations=ConversationService(db, pipeline, settings, hot.logs), hot=hot,
        callers=CallerCache(settings.accounts.auth_cache_s),
        blobs=LocalBlobStore(Path(settings.server.data_dir) / "blobs"),
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await db.migrate()
        await start_hot_state(hot, ctx.conversations, db, traffic.admission.max_running)
        # Answers left running by a dead process: alone, the sweeper marks them interrupted now, before the
        # first request; with shared state (Redis) their job leases lapse and another gateway takes them
        # over and continues them, and the sweeper marks those no lease covers once their writer is dead.
        sweeper = Sweeper(ctx.conversations, alone=not hot.shared)
        await sweeper.start()
        # Load the model in the background: /healthz answers at once, /readyz once it is loaded.
        loading = asyncio.create_task(_start_backend(backend, _app), name="backend-start")
        try:
            yield
        finally:
            await sweeper.stop()
            if hot.shared:
                # SIGTERM: running answers get shutdown_grace_s to finish, then go to other gateways.
                await ctx.conversations.shutdown(settings.shared_state.shutdown_grace_s, hand_over=True)
            else:
                # Running answers get until the drain deadline (counted from SIGTERM where the CLI saw it),
                # then are stopped and marked interrupted.
                started = getattr(app.state, "shutdown_started", None)
                spent = time.monotonic() - started if started is not None else 0.0
                await drain(ctx.conversations, max(0.0, settings.recovery.shutdown_drain_s - spent))
            await hot.close()
            if not loading.done():
                loading.cancel()
            if owns_backend:
                await backend.close()
            await traffic.moderator.close()
            await db.close()

    # Every route can get the edge's 400/413 (validation.EdgeGuard); the rest is declared per route.
    app = FastAPI(title="chatloom", version="0.1.0", lifespan=lifespan, responses=openapi_responses.EDGE)
    openapi_responses.install(app)
    app.state.ctx = ctx
    install_error_handlers(app)
    install_redis_errors(app, hot)
    app.add_middleware(RateLimitHeaders, traffic=lambda: ctx.traffic)
    app.add_middleware(EdgeGuard, max_body_bytes=settings.server.max_body_bytes,  # outermost: before any parsing
                       path_limits={portability.IMPORT_PATH: settings.portability.import_max_bytes})
    for module in (health, auth, sso, portability, conversations, sharing, memory, recovery, usage, admin, openai,
                   anthropic, moderations, responses, web):
        app.include_router(module.router)
    return app


async def _start_backend(backend: Backend, app: FastAPI) -> None:
    try:
        await backend.start()
    except ModelLoadFailed as exc:
        # No retry can help: where the CLI runs the server (app.state.stop_server), it stops and exits
        # with this reason; an app embedded elsewhere stays up with the reason on /readyz.
        log.error("%s", exc)
        app.state.startup_failure = str(exc)
        stop = getattr(app.state, "stop_server", None)
        if stop is not None:
            stop()
    except BackendError as exc:  # /readyz reports it
        log.error("%s", exc)
