"""Building the settings from their sources, with one-line errors that name the key."""
from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Mapping

from pydantic import ValidationError

from chatloom.settings.root import CONFIG_VALUES, Settings, SettingsError, nest, one_line


def check_toml(path: str | Path) -> dict[str, Any]:
    """The file's values; an unreadable file, a group or key that does not exist, or a value of the
    wrong type is refused with one line naming it."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise SettingsError(f"{path}: no such settings file") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path}: not valid TOML: {exc}") from None
    groups = Settings.model_fields
    for group, table in data.items():
        if not isinstance(table, dict):
            home = [g for g, f in groups.items() if group in f.annotation.model_fields]
            where = f"; it belongs in [{home[0]}]" if home else ""
            raise SettingsError(f"{path}: {group} is outside any table: settings go in [group] tables "
                                f"({', '.join(groups)}){where}")
        if group not in groups:
            raise SettingsError(f"{path}: unknown settings group [{group}] (known: {', '.join(groups)})")
        model = groups[group].annotation
        for key in table:
            if key not in model.model_fields:
                raise SettingsError(f"{path}: unknown setting {group}.{key}")
        try:  # strict: in a typed file, port = "80" is a mistake worth naming, not a string to coerce
            model.model_validate(table, strict=True)
        except ValidationError as exc:
            raise SettingsError(one_line(exc, origin=str(path), group=group)) from None
    return data


def load_settings(config_file: str | Path | None = None, flags: Mapping[str, Any] | None = None) -> Settings:
    """Defaults, then the TOML file, then CHATLOOM_<GROUP>__<KEY> environment variables, then the
    flags (dotted keys such as "engine.max_num_seqs"; None means the flag was not given)."""
    token = CONFIG_VALUES.set(check_toml(config_file) if config_file else None)
    try:
        return Settings(**nest(flags or {}))
    except ValidationError as exc:
        raise SettingsError(one_line(exc, origin=_origin(exc, flags or {}))) from None
    finally:
        CONFIG_VALUES.reset(token)


def _origin(exc: ValidationError, flags: Mapping[str, Any]) -> str:
    """Where the first wrong value came from: a flag or an environment variable (the file was checked first)."""
    import os

    from chatloom.settings.root import ENV_NESTED_DELIMITER, ENV_PREFIX

    loc = [str(p) for p in exc.errors()[0]["loc"]]
    if ".".join(loc[:2]) in flags:
        return "command line"
    name = ENV_PREFIX + ENV_NESTED_DELIMITER.join(loc[:2]).upper()
    return f"environment variable {name}" if name in os.environ else "settings"
