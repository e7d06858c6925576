"""The application factory: wires settings, database, backend and routes into a FastAPI app."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI

from chatloom.app.core import log_redaction
from chatloom.app.core.audit import AdminActions, AuditLog
from chatloom.app.core.auth import Passwords, Tokens
from chatloom.app.core.security_headers import install_security_headers
from chatloom.app.core.caller_cache import CallerCache
from chatloom.app.chat.conversation_service import ConversationService
from chatloom.app.api.deps import AppContext
from chatloom.app.api.error_handlers import install_error_handlers
from chatloom.app.state.hot_state import build_hot_state, install_redis_errors, start_hot_state
from chatloom.app.api import openapi_responses
from chatloom.app.generation.pipeline import Pipeline
from chatloom.app.chat.recovery import Sweeper, drain
from chatloom.app.api.batch_endpoints import batch_endpoints
from chatloom.app.api.routes import admin, anthropic, auth, conversations, health, moderations, openai, recovery
from chatloom.app.api.routes import responses, usage, web
from chatloom.app.api.routes import mcp_servers, tool_files
from chatloom.app.api.routes import audio, batches, embeddings, files, user_files
from chatloom.app.batch.runner import BatchRunner
from chatloom.app.files.builtin_embeddings import BuiltinEmbedder
from chatloom.app.files.remote_embeddings import RemoteEmbedder
from chatloom.app.files.retrieval import Retriever
from chatloom.app.files.service import Files
from chatloom.app.tools.hosted import HostedToolbox
from chatloom.app.api.routes import audit, memory, portability, sharing, sso
from chatloom.settings import Settings
from chatloom.app.traffic.control import RateLimitHeaders, Traffic, build_traffic, check_degrade_model
from chatloom.app.core.validation import EdgeGuard
from chatloom.engine import EngineConfig
from chatloom.models.static_embeddings import is_static
from chatloom.serving import Backend, BackendError, LocalBackend, ModelLoadFailed
from chatloom.serving import gc_pacing
from chatloom.serving.autoscale import AutoscaleConfig, PredictiveAutoscaler
from chatloom.serving.local_fleet import LocalReplicas
from chatloom.serving.local_scaler import LocalFleetScaler
from chatloom.serving.multi_model import MultiModelBackend
from chatloom.serving.router import Router
from chatloom.serving.speech import SpeechBackend
from chatloom.store import Database
from chatloom.store.blobs import LocalBlobStore

log = logging.getLogger(__name__)


def default_backend(settings: Settings) -> Backend:
    if settings.fleet.models or settings.fleet.replicas:  # several models, or replicas: the fleet
        from chatloom.app.core.fleet_settings import build_fleet_backend, fleet_from_settings

        fleet = fleet_from_settings(settings)
        return build_fleet_backend(fleet, lambda spec, pooling=None: local_backend(settings, spec, pooling))
    return local_backend(settings, settings.model.name)


def local_backend(settings: Settings, spec: str, pooling: str | None = None) -> Backend:
    return LocalBackend(spec, settings.model.dtype, EngineConfig.from_settings(settings.engine),
                        int8_matmul=settings.model.int8_matmul, bf16_matmul=settings.model.bf16_matmul,
                        pooling=pooling or settings.embeddings.pooling, mmproj=settings.model.mmproj)


def create_app(settings: Settings | None = None, backend: Backend | None = None,
               local_replicas: LocalReplicas | None = None, speech: SpeechBackend | None = None) -> FastAPI:
    """Build the app. Without a backend, the settings' model runs in-process (and is closed with the app);
    a backend passed in belongs to the caller. So does `speech`; without it, [speech] model (if set) is
    loaded in-process. With `local_replicas` (the processes the backend's router routes over) and
    autoscale.enabled, the autoscaler starts and drains them."""
    settings = settings or Settings()
    log_redaction.install()  # no secret reaches a log from here on
    owns_backend = backend is None
    backend = backend or default_backend(settings)
    owns_speech = speech is None
    if speech is None and settings.speech.model:
        speech = SpeechBackend(settings.speech.model, max_batch=settings.speech.max_batch)
    db = Database(settings.database_url)
    hot = build_hot_state(settings)  # quotas, stream logs, stops, job leases: in memory, or shared in Redis
    traffic = build_traffic(settings, backend, db)
    check_degrade_model(settings, backend)
    traffic.quotas = hot.quotas
    if hasattr(hot.quotas, "day_floor"):  # a shared store that lost a day's count starts it from metering
        discount = settings.traffic.cached_input_discount
        hot.quotas.day_floor = lambda user_id, day: traffic.meter.charged_on(user_id, day, discount)
    traffic.admission.fleet = hot.fleet
    traffic.admission.on_starting = backend.hold_background  # batch steps wait while interactive work starts
    pipeline = Pipeline(backend, traffic, settings)
    router = local_router(backend, local_replicas)
    if router is not None:  # N local replicas run N engines' generations at once
        traffic.size_admission(len(router.replicas))
    scaler = build_scaler(settings, traffic, router, local_replicas)
    blobs = LocalBlobStore(Path(settings.server.data_dir) / "blobs")
    # Passages and questions are embedded by a remote embedding server, the static embedding model in this
    # process (the default), or a served model.
    embedder = (RemoteEmbedder.from_settings(settings) if settings.files.embeddings_url
                else BuiltinEmbedder(settings.files.embedding_model) if is_static(settings.files.embedding_model)
                else pipeline.embeddings)
    file_service = Files(db, blobs, embedder, settings, traffic.tiers)
    retriever = Retriever(file_service, backend)
    ctx = AppContext(
        settings=settings, db=db, backend=backend,
        passwords=Passwords(settings.accounts.argon2_time_cost, settings.accounts.argon2_memory_kib),
        tokens=Tokens(settings.secret(), settings.accounts.token_ttl_s), traffic=traffic, pipeline=pipeline,
        conversations=ConversationService(db, pipeline, settings, hot.logs, blobs, retriever), hot=hot,
        callers=CallerCache(settings.accounts.auth_cache_s), blobs=blobs, files=file_service, retriever=retriever,
        speech=speech, scaler=scaler, hosted=HostedToolbox(settings, retriever), audit=AuditLog(db),
    )

    runner = BatchRunner(db, ctx.blobs, settings, batch_endpoints(ctx), hot.jobs.instance, hot.jobs.alive,
                         user_slots=lambda user: traffic.tier(user).max_concurrent,
                         quiet=traffic.admission.until_interactive_started)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await db.migrate(wait_s=settings.server.db_start_wait_s)
        await start_hot_state(hot, ctx.conversations, db, traffic.admission.max_running)
        await runner.start()  # batches: this gateway's, and those whose gateway stopped
        # Answers left running by a dead process: alone, the sweeper marks them interrupted now, before the
        # first request; with shared state (Redis) their job leases lapse and another gateway takes them
        # over and continues them, and the sweeper marks those no lease covers once their writer is dead.
        sweeper = Sweeper(ctx.conversations, alone=not hot.shared)
        await sweeper.start()
        # Load the model in the background: /healthz answers at once, /readyz once it is loaded.
        loading = asyncio.create_task(_start_backend(backend, _app), name="backend-start")
        scaling = asyncio.create_task(scaler.run(), name="autoscaler") if scaler is not None else None
        laddering = asyncio.create_task(traffic.follow_load(), name="degrade-ladder")
        speech_loading = asyncio.create_task(_start_speech(speech), name="speech-start") if speech else None
        # The static embedding model loads beside the chat model: its second is no request's.
        embedder_loading = (asyncio.create_task(embedder.start(), name="embedder-start")
                            if isinstance(embedder, BuiltinEmbedder) and settings.files.embeddings else None)
        try:
            yield
        finally:
            for task in filter(None, (scaling, laddering)):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await runner.close()  # running batch lines stop; their batches go on elsewhere or at the next start
            # Nothing of this gateway is starting any more: an engine that outlives it (a shared one in the
            # tests, a local replica) must not keep its batch work held.
            traffic.admission.on_starting = None
            backend.hold_background(False)
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
            if speech_loading is not None and not speech_loading.done():
                speech_loading.cancel()
            if embedder_loading is not None and not embedder_loading.done():
                embedder_loading.cancel()
            if speech is not None and owns_speech:
                await speech.close()
            await traffic.moderator.close()
            if isinstance(embedder, RemoteEmbedder):
                await embedder.close()
            await traffic.meter.close()  # answers have ended: flush their usage before the database closes
            await db.close()

    # Every route can get the edge's 400/413 (validation.EdgeGuard); the rest is declared per route.
    app = FastAPI(title="chatloom", version="0.1.0", lifespan=lifespan, responses=openapi_responses.EDGE)
    openapi_responses.install(app)
    app.state.ctx = ctx
    app.state.batch_runner = runner
    install_error_handlers(app)
    install_redis_errors(app, hot)
    app.add_middleware(RateLimitHeaders, traffic=lambda: ctx.traffic)
    # Outermost: before any parsing. /v1/files uploads stream to disk in their route, which checks each
    # purpose's limit (the edge only refuses a body declared larger than the largest, plus room for the
    # multipart framing); /files, audio and import bodies are read here up to their own limit.
    uploads = {"/v1/files": max(settings.files.max_bytes.values()) + 65_536}
    larger = {"/files": settings.files.max_file_bytes + 64_000,
              audio.TRANSCRIPTIONS: settings.speech.max_audio_bytes + audio.FORM_OVERHEAD,
              portability.IMPORT_PATH: settings.portability.import_max_bytes}
    app.add_middleware(EdgeGuard, max_body_bytes=settings.server.max_body_bytes, uploads=uploads, larger_bodies=larger)
    app.add_middleware(AdminActions, audit=lambda: ctx.audit)
    install_security_headers(app, settings)  # outermost: every answer gets the headers, refusals included
    routes = (health, auth, audit, sso, portability, conversations, sharing, memory, tool_files, mcp_servers, recovery,
              usage, admin, openai, responses, anthropic, moderations, embeddings, files, batches, user_files, audio,
              web)  # last: its catch-all serves the browser app
    for module in routes:
        app.include_router(module.router)
    return app


def local_router(backend: Backend, local: LocalReplicas | None) -> Router | None:
    """The router over the local replicas: the backend itself, or the default model's router where
    [[fleet.models]] adds other models beside them."""
    if local is None:
        return None
    candidates = backend.backends.values() if isinstance(backend, MultiModelBackend) else (backend,)
    return next((b for b in candidates if isinstance(b, Router) and {r.name for r in b.replicas} == set(local.urls)),
                None)


def build_scaler(settings: Settings, traffic: Traffic, router: Router | None,
                 local: LocalReplicas | None) -> LocalFleetScaler | None:
    """The autoscaler, when it is on: acting on the local replicas `router` routes over, or only
    reporting on /metrics the replicas it wants. The admission queue follows the replicas serving."""
    a = settings.autoscale
    if not a.enabled:
        return None
    config = AutoscaleConfig(a.min_replicas, a.max_replicas, a.capacity_rps, 120.0 if a.startup_s is None else a.startup_s,
                             a.interval_s, a.headroom, a.scale_down_hold_s)
    scaler = LocalFleetScaler(PredictiveAutoscaler(config), lambda: traffic.arrivals, router,
                              local if router is not None else None, on_resize=traffic.size_admission)
    scaler.autoscaler.desired = len(local.urls) if local is not None else a.min_replicas
    scaler.register(traffic.metrics.registry)
    return scaler


async def _start_speech(speech: SpeechBackend) -> None:
    """Load the speech model; a failure leaves the transcription endpoint answering 503 with the reason."""
    try:
        await speech.start()
    except ModelLoadFailed as exc:
        log.error("%s", exc)


async def _start_backend(backend: Backend, app: FastAPI) -> None:
    try:
        await backend.start()
        gc_pacing.after_load()  # what the model's load built joins the startup heap no collection walks
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
