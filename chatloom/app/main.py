"""The application factory: wires settings, database, backend and routes into a FastAPI app."""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI

from chatloom.app.auth import Passwords, Tokens
from chatloom.app.conversation_service import ConversationService
from chatloom.app.deps import AppContext
from chatloom.app.errors import install_error_handlers
from chatloom.app.hotstate.state import build_hot_state, install_redis_errors, start_hot_state
from chatloom.app.pipeline import Pipeline
from chatloom.app.routes import admin, auth, conversations, health, openai, usage, web
from chatloom.app.settings import Settings
from chatloom.app.traffic import RateLimitHeaders, build_traffic
from chatloom.model_args import int8_matmul
from chatloom.serving import Backend, BackendError, LocalBackend
from chatloom.store import Database

log = logging.getLogger(__name__)


def default_backend(settings: Settings) -> Backend:
    return LocalBackend(settings.model, settings.dtype, settings.engine_config(),
                        int8_matmul=int8_matmul(settings.int8_matmul))  # the switch resolved once, here


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
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await db.migrate()
        await start_hot_state(hot, ctx.conversations, db, traffic.admission.max_running)
        # Load the model in the background: /healthz answers at once, /readyz once it is loaded.
        loading = asyncio.create_task(_start_backend(backend), name="backend-start")
        try:
            yield
        finally:
            # SIGTERM: running answers get shutdown_grace_s to finish, then go to other gateways (or stop).
            await ctx.conversations.shutdown(settings.shutdown_grace_s, hand_over=hot.shared)
            await hot.close()
            if not loading.done():
                loading.cancel()
            if owns_backend:
                await backend.close()
            await traffic.moderator.close()
            await db.close()

    app = FastAPI(title="chatloom", version="0.1.0", lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    install_redis_errors(app, hot)
    app.add_middleware(RateLimitHeaders, traffic=lambda: ctx.traffic)
    for module in (health, auth, conversations, usage, admin, openai, web):
        app.include_router(module.router)
    return app


async def _start_backend(backend: Backend) -> None:
    try:
        await backend.start()
    except BackendError as exc:  # /readyz reports it
        log.error("%s", exc)
