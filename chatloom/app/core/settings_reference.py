"""The configuration reference page (docs/configuration.md), generated from the settings tree.

`python -m chatloom.app.core.settings_reference` writes the page; `--check` only compares and exits 1
when it is out of date (a test does the same, so the page cannot drift from the code). Each group
of the tree is a section (a TOML table); each key shows its type, default, environment variable,
the `chatloom serve` flag that sets it, and its description, all read from the tree itself.
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import types
import typing

from pydantic import BaseModel
from pathlib import Path
from typing import Any

from chatloom.settings import Settings
from chatloom.settings.root import ENV_NESTED_DELIMITER, ENV_PREFIX

DEFAULT_OUTPUT = Path("docs/configuration.md")
COMMAND = "python -m chatloom.app.core.settings_reference"


def format_default(value: Any) -> str:
    """A default as a TOML value would spell it, or "unset"."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, BaseModel):
        value = value.model_dump(exclude_none=True)
    if isinstance(value, dict):
        value = {k: v.model_dump(exclude_none=True) if isinstance(v, BaseModel) else v for k, v in value.items()}
    return repr(value) if isinstance(value, (int, float)) else json.dumps(value, sort_keys=True, default=str)


def format_type(annotation: Any) -> str:
    """`str | None`, `int`, `list[str]`, `"a" | "b"`."""
    if annotation is type(None):
        return "None"
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) if isinstance(a, str) else repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(format_type(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = typing.get_args(annotation)
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(format_type(a) for a in args)}]" if args else name
    return getattr(annotation, "__name__", str(annotation))


def _cell(text: str) -> str:
    return text.replace("<", "&lt;").replace("|", "\\|").replace("*", "\\*")


def serve_flags() -> dict[str, str]:
    """Dotted setting key -> the `chatloom serve` option that sets it."""
    from chatloom.cli.serve import SETTING_FLAGS

    return {key: "--" + dest.replace("_", "-") for dest, key in SETTING_FLAGS.items()}


def render(flags: dict[str, str] | None = None) -> str:
    """The whole page."""
    flags = serve_flags() if flags is None else flags
    import chatloom.settings.root as root

    out = ["# Configuration reference", "",
           f"<!-- Generated from the settings tree (chatloom/settings) by `{COMMAND}`; do not edit by hand. -->", "",
           inspect.getdoc(root) or "", "",
           "Every setting, by group: its type, its default, the environment variable and the `chatloom serve`",
           "flag that set it. In the TOML file given to `--config`, a group is a table:", "",
           "```toml", "[engine]", "kv_cache_gb = 4", "", "[sampling]", "temperature = 0.2", "```", "",
           "\"unset\" means no value: the description says what applies then. A key that does not exist, or a",
           "value of the wrong type, stops the command with one line naming the key.", ""]
    for group, field in Settings.model_fields.items():
        model = field.annotation
        out += [f"## [{group}]", "", inspect.getdoc(model) or "", "",
                "| Key | Type | Default | Environment | Flag | Description |", "|---|---|---|---|---|---|"]
        for name, sub in model.model_fields.items():
            key = f"{group}.{name}"
            env = f"`{ENV_PREFIX}{group.upper()}{ENV_NESTED_DELIMITER}{name.upper()}`"
            flag = f"`{flags[key]}`" if key in flags else ""
            out.append(f"| `{name}` | `{format_type(sub.annotation)}` | `{format_default(sub.get_default(call_default_factory=True))}` | {env} | "
                       f"{flag} | {_cell(sub.description or '')} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="write (or check) the configuration reference page")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"the page (default {DEFAULT_OUTPUT})")
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the page is out of date")
    args = parser.parse_args(argv)
    page = render()
    current = args.output.read_text(encoding="utf-8") if args.output.is_file() else None
    if args.check:
        if current != page:
            print(f"{args.output} is out of date: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if current != page:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(page, encoding="utf-8")
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
