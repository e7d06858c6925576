"""Serving the app over HTTP: uvicorn for plain HTTP/1.1, Hypercorn for HTTP/2 over TLS.

Browsers open at most six HTTP/1.1 connections per host, and every open chat tab holds one SSE
stream, so a seventh tab stalls. Over HTTP/2 all streams share one connection (Hypercorn allows
100 concurrent streams per connection by default). Browsers speak HTTP/2 only over TLS, hence
`--tls-cert/--tls-key` switch to Hypercorn with ALPN offering h2 and http/1.1.

Both servers stop on SIGTERM or SIGINT: they stop accepting connections, then the app's shutdown
(chatloom.app.main) lets running answers finish up to `shutdown_grace_s` and hands the rest over to
other gateways.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import ssl
from typing import Callable

from chatloom.settings import Settings

log = logging.getLogger(__name__)


def hypercorn_config(settings: Settings, tls_cert: str, tls_key: str):
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"{settings.server.host}:{settings.server.port}"]
    config.certfile = tls_cert
    config.keyfile = tls_key
    config.alpn_protocols = ["h2", "http/1.1"]
    # Open SSE connections are closed after 2 s (clients resume elsewhere with Last-Event-ID); the
    # answers themselves are jobs, finished or handed over by the app's shutdown.
    config.graceful_timeout = 2.0
    config.loglevel = settings.server.log_level.upper()
    config.accesslog = None
    return config


async def serve_h2(app, settings: Settings, tls_cert: str, tls_key: str,
                   stop: asyncio.Event | None = None) -> None:
    """Serve `app` over TLS (HTTP/2 or HTTP/1.1, as the client picks) until SIGTERM/SIGINT or `stop`."""
    from hypercorn.asyncio import serve

    stop = stop or asyncio.Event()
    app.state.stop_server = stop.set  # the app stops the server itself when its model cannot load
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    previous = loop.get_exception_handler()
    loop.set_exception_handler(quiet_tls_closes_at_shutdown(stop.is_set))
    try:
        await serve(app, hypercorn_config(settings, tls_cert, tls_key), shutdown_trigger=stop.wait)
    except Exception as exc:
        if not stop.is_set():
            raise
        # Hypercorn 0.18 raises its connections' errors (a TaskGroup shutting down, a stream id it already
        # dropped) out of serve() when it closes HTTP/2 connections with SSE streams open at shutdown. The
        # shutdown itself has run by then (answers finished or handed over): a clean stop, not a crash.
        log.warning("HTTP/2 connections open at shutdown were closed with errors: %s", _summary(exc))
    finally:
        loop.set_exception_handler(previous)


def quiet_tls_closes_at_shutdown(stopping: Callable[[], bool]):
    """The event loop's error handler while Hypercorn serves: a TLS error from closing a connection once
    the server is stopping (a client that sent data after the close, say) is one debug line, not an
    ERROR traceback from asyncio for every connection a drain closes. Anything else goes to asyncio."""
    def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if stopping() and isinstance(exc, ssl.SSLError):
            log.debug("TLS connection closed with an error at shutdown: %s", exc)
            return
        loop.default_exception_handler(context)
    return handle


def _summary(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(sorted({_summary(e) for e in exc.exceptions}))
    return f"{type(exc).__name__}: {exc}"


def run(app, settings: Settings, tls_cert: str | None = None, tls_key: str | None = None) -> None:
    if tls_cert or tls_key:
        if not (tls_cert and tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        asyncio.run(serve_h2(app, settings, tls_cert, tls_key))
        return
    import uvicorn

    uvicorn.run(app, host=settings.server.host, port=settings.server.port, log_level=settings.server.log_level,
                timeout_graceful_shutdown=2)
