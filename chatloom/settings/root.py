"""The root of the settings tree and where its values come from.

Precedence, lowest first: the defaults in tree.py, a TOML file (`--config FILE`), environment
variables (`CHATLOOM_<GROUP>__<KEY>`, e.g. CHATLOOM_ENGINE__KV_CACHE_GB=4), then command-line flags.
"""
from __future__ import annotations

import os
import secrets
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Mapping

from pydantic import Field
from pydantic import ValidationError
from pydantic_settings import (BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict,
                               InitSettingsSource)

from chatloom.settings.tree import (AccountSettings, BatchSettings, ChatSettings, EmbeddingsSettings, EngineSettings,
                                    FilesSettings, FleetSettings, MemorySettings, ModelSettings, ModerationSettings,
                                    PortabilitySettings, RecoverySettings, RuntimeSettings, SamplingSettings,
                                    ServerSettings, SharedStateSettings, SpeechSettings, SsoSettings, ToolsSettings,
                                    TrafficSettings, VisionSettings, DegradeSettings, AutoscaleSettings)

ENV_PREFIX = "CHATLOOM_"
ENV_NESTED_DELIMITER = "__"
# The settings file's values, read and checked once by load_settings, for the file source below.
CONFIG_VALUES: ContextVar[dict | None] = ContextVar("chatloom_config_values", default=None)


class Settings(BaseSettings):
    """Every setting of chatloom, as a tree of groups."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_NESTED_DELIMITER,
                                      extra="forbid", validate_assignment=True, nested_model_default_partial_update=True)

    server: ServerSettings = Field(default_factory=ServerSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    accounts: AccountSettings = Field(default_factory=AccountSettings)
    chat: ChatSettings = Field(default_factory=ChatSettings)
    tools: ToolsSettings = Field(default_factory=ToolsSettings)
    traffic: TrafficSettings = Field(default_factory=TrafficSettings)
    degrade: DegradeSettings = Field(default_factory=DegradeSettings)
    autoscale: AutoscaleSettings = Field(default_factory=AutoscaleSettings)
    moderation: ModerationSettings = Field(default_factory=ModerationSettings)
    vision: VisionSettings = Field(default_factory=VisionSettings)
    speech: SpeechSettings = Field(default_factory=SpeechSettings)
    fleet: FleetSettings = Field(default_factory=FleetSettings)
    embeddings: EmbeddingsSettings = Field(default_factory=EmbeddingsSettings)
    files: FilesSettings = Field(default_factory=FilesSettings)
    batch: BatchSettings = Field(default_factory=BatchSettings)
    recovery: RecoverySettings = Field(default_factory=RecoverySettings)
    shared_state: SharedStateSettings = Field(default_factory=SharedStateSettings)
    runtime: RuntimeSettings = Field(default_factory=RuntimeSettings)
    portability: PortabilitySettings = Field(default_factory=PortabilitySettings)
    memory: MemorySettings = Field(default_factory=MemorySettings)
    sso: SsoSettings = Field(default_factory=SsoSettings)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings],
                                   init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource):
        # Earlier sources win: flags (passed as init values), then the environment, then the file.
        values = CONFIG_VALUES.get()
        file_source = (InitSettingsSource(settings_cls, values),) if values else ()
        return (init_settings, env_settings, *file_source)

    @property
    def database_url(self) -> str:
        if self.server.db_url:
            return self.server.db_url
        return f"sqlite+aiosqlite:///{Path(self.server.data_dir) / 'chatloom.db'}"

    def secret(self) -> str:
        """The JWT signing key; generated and kept on disk so tokens survive restarts."""
        if self.accounts.jwt_secret:
            return self.accounts.jwt_secret
        path = Path(self.server.data_dir) / "jwt_secret"
        if path.is_file():
            self.accounts.jwt_secret = path.read_text().strip()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.accounts.jwt_secret = secrets.token_urlsafe(48)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.accounts.jwt_secret)
        return self.accounts.jwt_secret

    def with_values(self, values: Mapping[str, Any]) -> "Settings":
        """A copy with dotted keys changed (`{"engine.max_num_seqs": 8}`); None values are skipped."""
        data = self.model_dump()
        for group, changes in nest(values).items():
            data[group].update(changes)
        return validated(data)


class SettingsError(ValueError):
    """A setting that is unknown or has the wrong type; the message is one line naming it."""


def nest(values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """{"engine.max_num_seqs": 8} -> {"engine": {"max_num_seqs": 8}}; None values are left out."""
    tree: dict[str, dict[str, Any]] = {}
    groups = Settings.model_fields
    for key, value in values.items():
        if value is None:
            continue
        group, dot, name = key.partition(".")
        if not dot or group not in groups or name not in groups[group].annotation.model_fields:
            raise SettingsError(f"unknown setting {key!r}")
        tree.setdefault(group, {})[name] = value
    return tree


def validated(data: Mapping[str, Any]) -> Settings:
    """The Settings for a tree of values, without reading the environment or a file again."""
    try:
        return Settings.model_validate(dict(data))
    except ValidationError as exc:
        raise SettingsError(one_line(exc)) from None


def one_line(exc: ValidationError, origin: str = "", group: str = "") -> str:
    """The first problem of a validation error as one line naming the key and what was expected."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in ((group,) if group else ()) + tuple(err["loc"]))
    lead = f"{origin}: " if origin else ""
    if err["type"] == "extra_forbidden":
        return f"{lead}unknown setting {where}"
    value = err.get("input")
    shown = "" if isinstance(value, (dict, list)) else f", not {value!r}"
    msg = err["msg"]
    return f"{lead}setting {where}: {msg[0].lower()}{msg[1:]}{shown}"
