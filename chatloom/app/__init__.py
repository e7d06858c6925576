"""The product: auth, conversations, prompt assembly, streams, the REST/SSE and OpenAI-compatible routes.

`create_app` is imported lazily so that `chatloom.cli.serve` (loaded for every CLI command) stays light.
"""
from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from chatloom.app.main import create_app
        return create_app
    raise AttributeError(name)
