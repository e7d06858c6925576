"""The browser chat app: index.html at / and its static files under /web/, straight from chatloom/web/.

No build step and nothing from a CDN: every file the page loads comes from this folder. The page
gets a strict Content-Security-Policy, so even if model text ever slipped past the Markdown
renderer's escaping, the browser would run no inline script or event handler.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from chatloom.app.core.errors import not_found

WEB_DIR = Path(__file__).resolve().parents[3] / "web"

MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png",
               ".ico": "image/x-icon", ".json": "application/json"}

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")

HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", "Content-Security-Policy": CSP,
           "Referrer-Policy": "no-referrer"}

router = APIRouter(tags=["web"], include_in_schema=False)


def page(path: Path) -> FileResponse:
    """A file of chatloom/web/ with the app's headers (strict CSP, no caching, no referrer)."""
    return _file(path)


def _file(path: Path) -> FileResponse:
    return FileResponse(path, media_type=MEDIA_TYPES.get(path.suffix, "application/octet-stream"), headers=HEADERS)


@router.get("/")
async def index() -> FileResponse:
    return _file(WEB_DIR / "index.html")


@router.get("/web/{name:path}")
async def static_file(name: str) -> FileResponse:
    path = (WEB_DIR / name).resolve()
    # Only plain files inside chatloom/web/ with a known type (no ../ escapes, no folders).
    if WEB_DIR not in path.parents or not path.is_file() or path.suffix not in MEDIA_TYPES:
        raise not_found("file")
    return _file(path)
