"""Server-sent events framing."""
from __future__ import annotations

import json

from fastapi.responses import StreamingResponse

from chatloom.app.state.events import StreamEvent


class EventStreamResponse(StreamingResponse):
    """A server-sent event stream; as a route's response_class it makes the OpenAPI schema say
    text/event-stream rather than JSON."""

    media_type = "text/event-stream"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # keep proxies from buffering


def frame(data: dict | str, event_id: int | str | None = None, event: str | None = None) -> bytes:
    lines = []
    if event_id is not None:
        lines.append(f"id: {event_id}")
    if event:
        lines.append(f"event: {event}")
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    # A data field cannot hold a newline; JSON never has raw ones, but plain strings might.
    lines.extend(f"data: {line}" for line in payload.split("\n"))
    return ("\n".join(lines) + "\n\n").encode()


def frame_event(ev: StreamEvent) -> bytes:
    return frame(ev.data, ev.id, ev.event)


HEARTBEAT = b": keep-alive\n\n"
