"""The configuration reference page, generated from the settings class.

`python -m chatloom.app.settings_doc` writes docs/configuration.md; `--check` only compares and
exits 1 when the page is out of date (a test does the same, so the page cannot drift from the code).
Everything on the page is read from the class itself:

- a pydantic-settings class: `model_fields` (annotation, default, description), the environment
  prefix, aliases and nested-model delimiter from `model_config`; a field holding a model becomes a
  section of dotted keys (a TOML table);
- a dataclass: its fields, with the help text taken from the source comments beside and directly
  above each field; a comment block after a blank line opens a section. An environment variable
  comes from a field's `metadata["env"]`, or from a `$NAME` its help text mentions.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_OUTPUT = Path("docs/configuration.md")
_ENV_MENTION = re.compile(r"\$([A-Z][A-Z0-9_]*)")


@dataclass(frozen=True)
class SettingDoc:
    key: str  # the TOML key; dotted for a key inside a table
    type: str
    default: str  # as it would be written in TOML, or "unset" / "required"
    env: tuple[str, ...]
    help: str


@dataclass(frozen=True)
class Section:
    title: str
    note: str
    settings: tuple[SettingDoc, ...]


def describe(cls: type) -> list[Section]:
    """The settings of `cls`, in sections, in declaration order."""
    if hasattr(cls, "model_fields"):
        return _describe_pydantic(cls)
    if dataclasses.is_dataclass(cls):
        return _describe_dataclass(cls)
    raise TypeError(f"{cls.__name__} is neither a dataclass nor a pydantic model")


# -- values --------------------------------------------------------------------------

def format_default(value: Any) -> str:
    """A default as a TOML value would spell it."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (int, float)):
        return repr(value)
    if hasattr(value, "model_dump"):  # a nested pydantic model: its keys are listed apart
        return "(table)"
    try:
        return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    except TypeError:
        return repr(value)


def format_type(annotation: Any) -> str:
    """`str | None`, `int`, `list[str]`, `"a" | "b"` for an annotation object or string."""
    if isinstance(annotation, str):
        return annotation
    if annotation is type(None):
        return "None"
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) if isinstance(a, str) else repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(format_type(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return format_type(typing.get_args(annotation)[0])
    if origin is not None:
        args = typing.get_args(annotation)
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(format_type(a) for a in args)}]" if args else name
    return getattr(annotation, "__name__", str(annotation))


# -- dataclass: help text from the source comments -----------------------------------

def _describe_dataclass(cls: type) -> list[Section]:
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    trailing, alone = _comments(source)
    body = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)).body
    declared = {f.name: f for f in dataclasses.fields(cls)}
    sections: list[Section] = []
    title, note, rows = "General", "", []
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.target.id in declared):
            continue
        block, first = _comment_block_above(node.lineno, alone)
        above = first - 1  # the line before the comments (1-based), or before the field
        opens_section = above < 1 or not lines[above - 1].strip() or _is_class_header(lines, above)
        help_above = ""
        if opens_section and (block or rows):
            if rows:
                sections.append(Section(title, note, tuple(rows)))
            title, note = _section_title(block) if block else ("Other", "")
            rows = []
        elif block:
            help_above = block
        help_beside = " ".join(trailing.get(n, "") for n in range(node.lineno, (node.end_lineno or node.lineno) + 1))
        text = _sentence(" ".join(t for t in (help_above, help_beside.strip()) if t))
        rows.append(_dataclass_row(declared[node.target.id], text))
    if rows:
        sections.append(Section(title, note, tuple(rows)))
    return sections


def _comments(source: str) -> tuple[dict[int, str], dict[int, str]]:
    """Comments beside code and comments alone on their line, by 1-based line number."""
    beside: dict[int, str] = {}
    alone: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            (beside if tok.start[0] in code_lines else alone)[tok.start[0]] = text
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER, tokenize.ENCODING):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    return beside, alone


def _comment_block_above(lineno: int, alone: dict[int, str]) -> tuple[str, int]:
    """The comment lines directly above `lineno`, joined, and the first of them (or lineno)."""
    first = lineno
    while first - 1 in alone:
        first -= 1
    return " ".join(alone[n] for n in range(first, lineno)), first


def _is_class_header(lines: list[str], lineno: int) -> bool:
    """Whether 1-based `lineno` ends the class statement or its docstring (nothing above in the body)."""
    text = lines[lineno - 1].strip()
    return text.startswith("class ") or text.endswith(('"""', "'''"))


def _section_title(comment: str) -> tuple[str, str]:
    """'Accounts.' -> ('Accounts', ''); 'Engine sizing (x); y.' -> ('Engine sizing', the whole comment)."""
    title = re.split(r" \(|:|;|\. |\.$", comment, maxsplit=1)[0].strip()
    rest = comment.strip()
    return title, "" if rest.rstrip(".") == title else _sentence(rest)


def _sentence(text: str) -> str:
    return " ".join(text.split())


def _dataclass_row(field: dataclasses.Field, text: str) -> SettingDoc:
    if field.default is not dataclasses.MISSING:
        default = format_default(field.default)
    elif field.default_factory is not dataclasses.MISSING:
        default = format_default(field.default_factory())
    else:
        default = "required"
    env = field.metadata.get("env", ())
    env = (env,) if isinstance(env, str) else tuple(env)
    env += tuple(name for name in _ENV_MENTION.findall(text) if name not in env)
    return SettingDoc(field.name, format_type(field.type), default, env, text)


# -- pydantic-settings ---------------------------------------------------------------

def _describe_pydantic(cls: type) -> list[Section]:
    config = getattr(cls, "model_config", {}) or {}
    prefix = config.get("env_prefix", "") or ""
    delimiter = config.get("env_nested_delimiter") or None
    upper = not config.get("case_sensitive", False)
    top: list[SettingDoc] = []
    tables: list[Section] = []
    for name, field in cls.model_fields.items():
        env = _pydantic_env(name, field, prefix, upper)
        nested = _model_class(field.annotation)
        if nested is not None:
            env_prefix = (env[0] + delimiter) if (delimiter and env) else None
            rows = tuple(_pydantic_rows(nested, f"{name}.", env_prefix, delimiter, upper))
            doc = inspect.getdoc(nested) if nested.__doc__ else ""
            tables.append(Section(f"[{name}]", _sentence(field.description or doc or ""), rows))
        else:
            top.append(_pydantic_row(name, field, env))
    return ([Section("General", "", tuple(top))] if top else []) + tables


def _pydantic_rows(model: type, key_prefix: str, env_prefix: str | None, delimiter: str | None,
                   upper: bool) -> list[SettingDoc]:
    """A nested model's keys; environment names only where a nested delimiter is configured."""
    rows: list[SettingDoc] = []
    for name, field in model.model_fields.items():
        env = (_case(env_prefix + name, upper),) if env_prefix is not None else ()
        nested = _model_class(field.annotation)
        if nested is not None:
            deeper = env[0] + delimiter if env and delimiter else None
            rows.extend(_pydantic_rows(nested, f"{key_prefix}{name}.", deeper, delimiter, upper))
        else:
            rows.append(_pydantic_row(key_prefix + name, field, env))
    return rows


def _pydantic_row(key: str, field: Any, env: tuple[str, ...]) -> SettingDoc:
    if field.is_required():
        default = "required"
    else:
        default = format_default(field.get_default(call_default_factory=True))
    return SettingDoc(key, format_type(field.annotation), default, env, _sentence(field.description or ""))


def _pydantic_env(name: str, field: Any, prefix: str, upper: bool) -> tuple[str, ...]:
    """pydantic-settings' names for a top-level field: an alias as written, else prefix + name."""
    alias = field.validation_alias if field.validation_alias is not None else field.alias
    if isinstance(alias, str):
        return (_case(alias, upper),)
    choices = getattr(alias, "choices", None)
    if choices:
        return tuple(_case(c, upper) for c in choices if isinstance(c, str))
    return (_case(prefix + name, upper),)


def _case(name: str, upper: bool) -> str:
    return name.upper() if upper else name


def _model_class(annotation: Any) -> type | None:
    """The pydantic model a field holds (also inside `X | None`), or None."""
    candidates = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        else (annotation,)
    for c in candidates:
        if isinstance(c, type) and hasattr(c, "model_fields"):
            return c
    return None


# -- the page ------------------------------------------------------------------------

def _cell(text: str) -> str:
    """Table-cell text: pipes and HTML escaped, $NAME mentions as code."""
    text = text.replace("<", "&lt;").replace("|", "\\|").replace("*", "\\*")
    return _ENV_MENTION.sub(lambda m: f"`{m.group(1)}`", text)


@dataclass(frozen=True)
class Flag:
    option: str  # --kv-cache-gb
    help: str


def serve_flags(keys: set[str]) -> dict[str, Flag]:
    """`chatloom serve`'s flags that set a setting: an option whose dest is a key, or the key less `_url`."""
    from chatloom.app.cli import register

    parser = argparse.ArgumentParser(prog="chatloom")
    register(parser.add_subparsers())
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    flags: dict[str, Flag] = {}
    for action in serve._actions:
        key = next((k for k in (action.dest, f"{action.dest}_url") if k in keys), None)
        if key and action.option_strings:
            option = max(action.option_strings, key=len)
            flags[key] = Flag(option, _sentence((action.help or "") % vars(action) if action.help else ""))
    return flags


def render(cls: type, flags: dict[str, Flag] | None = None) -> str:
    """The whole configuration page for the settings class `cls`; `flags` adds the command-line flag
    that sets a key (its help stands in for a key without help text of its own)."""
    flags = flags or {}
    module = inspect.getmodule(cls)
    intro = inspect.getdoc(module) if module is not None and module.__doc__ else ""
    where = f"{cls.__module__}.{cls.__qualname__}"
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated from {where} by `python -m chatloom.app.settings_doc`; do not edit by hand. -->",
        "",
    ]
    if intro:
        out += [intro, ""]
    out += [
        f"Every setting of `{where}`: its type, its default, and the environment variable and the",
        "`chatloom serve` flag that set it, where there are any. In the TOML file given to `--config`, a key",
        "is written as shown (a dotted key is a key inside a TOML table). \"unset\" means no value: the",
        "description says what applies then.",
        "",
    ]
    for section in describe(cls):
        out += [f"## {section.title}", ""]
        if section.note:
            out += [_cell(section.note).replace("\\|", "|").replace("\\*", "*"), ""]
        out += ["| Key | Type | Default | Environment | Flag | Description |", "|---|---|---|---|---|---|"]
        for s in section.settings:
            env = ", ".join(f"`{e}`" for e in s.env)
            flag = flags.get(s.key)
            option = f"`{flag.option}`" if flag else ""
            text = s.help or (flag.help if flag else "")
            # Inside a code span a pipe does not split the cell (Python-Markdown's tables), so it stays as is.
            out.append(f"| `{s.key}` | `{s.type}` | `{s.default}` | {env} | {option} | {_cell(text)} |")
        out.append("")
    return "\n".join(out)


def _settings_class() -> type:
    from chatloom.app.settings import Settings

    return Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chatloom.app.settings_doc",
                                     description="write (or check) the configuration reference page")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"the page (default {DEFAULT_OUTPUT})")
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the page is out of date")
    args = parser.parse_args(argv)
    cls = _settings_class()
    page = render(cls, serve_flags({s.key for section in describe(cls) for s in section.settings}))
    current = args.output.read_text(encoding="utf-8") if args.output.is_file() else None
    if args.check:
        if current != page:
            print(f"{args.output} is out of date: run `python -m chatloom.app.settings_doc`", file=sys.stderr)
            return 1
        return 0
    if current != page:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(page, encoding="utf-8")
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
