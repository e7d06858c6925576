"""The application factory: wires settings, database, backend and routes into a FastAPI app."""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI

from chatloom.app.core.auth import Passwords, Tokens
from chatloom.app.core.caller_cache import CallerCache
from chatloom.app.chat.conversation_service import ConversationService
from chatloom.app.api.deps import AppContext
from chatloom.app.core.errors import install_error_handlers
from chatloom.app.state.hot_state import build_hot_state, install_redis_errors, start_hot_state
from chatloom.app.api import openapi_responses
from chatloom.app.generation.pipeline import Pipeline
from chatloom.app.chat.recovery import Sweeper, drain
from chatloom.app.api.routes import (admin, anthropic, auth, conversations, health, moderations, openai, recovery,
                                     usage, web)
from chatloom.app.core.settings import Settings
from chatloom.app.traffic.control import RateLimitHeaders, build_traffic
from chatloom.app.core.validation import EdgeGuard
from chatloom.model_args import bf16_matmul, int8_matmul
from chatloom.serving import Backend, BackendError, LocalBackend
from chatloom.store import Database

log = logging.getLogger(__name__)


def default_backend(settings: Settings) -> Backend:
    if settings.models or settings.replicas:  # several models, or replicas: the fleet
        from chatloom.app.core.fleet_settings import build_fleet_backend, parse_fleet

        fleet = parse_fleet(settings.models, settings.replicas, settings.router_policy, settings.router_weights,
                            settings.model)
        return build_fleet_backend(fleet, lambda spec: local_backend(settings, spec))
    return local_backend(settings, settings.model)


def local_backend(settings: Settings, spec: str) -> Backend:
    return LocalBackend(spec, settings.dtype, settings.engine_config(),
                        int8_matmul=int8_matmul(settings.int8_matmul),  # the switches resolved once, here
                        bf16_matmul=bf16_matmul(None))


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
        passwords=Passwords(settings.argon2_time_cost, settings.argon2_memory_kib),
        tokens=Tokens(settings.secret(), settings.token_ttl_s), traffic=traffic, pipeline=pipeline,
        conversations=ConversationService(db, pipeline, settings, hot.logs), hot=hot,
        callers=CallerCache(settings.auth_cache_s),
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await db.migrate()
        await start_hot_state(hot, ctx.conversations, db, traffic.admission.max_running)
        # Answers left running by a dead process: alone, the sweeper marks them interrupted; with shared
        # state (Redis) their job leases lapse and another gateway takes them over and continues them.
        sweeper = None if hot.shared else Sweeper(ctx.conversations)
        if sweeper is not None:
            await sweeper.start()
        # Load the model in the background: /healthz answers at once, /readyz once it is loaded.
        loading = asyncio.create_task(_start_backend(backend), name="backend-start")
        try:
            yield
        finally:
            if sweeper is not None:
                await sweeper.stop()
            if hot.shared:
                # SIGTERM: running answers get shutdown_grace_s to finish, then go to other gateways.
                await ctx.conversations.shutdown(settings.shutdown_grace_s, hand_over=True)
            else:
                # Running answers get until the drain deadline (counted from SIGTERM where the CLI saw it),
                # then are stopped and marked interrupted.
                started = getattr(app.state, "shutdown_started", None)
                spent = time.monotonic() - started if started is not None else 0.0
                await drain(ctx.conversations, max(0.0, settings.shutdown_drain_s - spent))
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
    app.add_middleware(EdgeGuard, max_body_bytes=settings.max_body_bytes)  # outermost: before any parsing
    for module in (health, auth, conversations, recovery, usage, admin, openai, anthropic, moderations, web):
        app.include_router(module.router)
    return app


async def _start_backend(backend: Backend) -> None:
    try:
        await backend.start()
    except BackendError as exc:  # /readyz reports it
        log.error("%s", exc)
