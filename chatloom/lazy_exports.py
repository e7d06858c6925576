"""Package exports loaded on first use (PEP 562), so that one module of a package can be imported
without everything its package's `__init__` names (and torch behind some of it)."""
from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_getattr(package: str, exports: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: `exports` maps a name to the module defining it; a name is
    imported on first use and kept in `namespace` (the package's globals), so later uses are plain."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(exports[name]), name)
        return value

    return __getattr__
