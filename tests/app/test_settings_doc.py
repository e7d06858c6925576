"""The configuration reference page is generated from the settings class and must not drift from it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from chatloom.app import settings_doc
from chatloom.app.settings import Settings

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _current_page() -> str:
    return settings_doc.render(Settings, settings_doc.serve_flags({f.name for f in dataclasses.fields(Settings)}))


def test_the_configuration_page_is_what_the_generator_writes_now() -> None:
    assert PAGE.is_file(), "docs/configuration.md is missing: run `python -m chatloom.app.settings_doc`"
    assert PAGE.read_text(encoding="utf-8") == _current_page(), (
        "docs/configuration.md differs from the settings: run `python -m chatloom.app.settings_doc`")


def test_every_setting_has_a_row_with_its_default() -> None:
    page = _current_page()
    for f in dataclasses.fields(Settings):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert f"| `{f.name}` | " in page
        row = next(line for line in page.splitlines() if line.startswith(f"| `{f.name}` | "))
        assert f"`{settings_doc.format_default(default)}`" in row


def test_check_mode_fails_on_a_stale_page_and_passes_once_written(tmp_path: Path) -> None:
    page = tmp_path / "configuration.md"
    page.write_text(_current_page().replace("`8000`", "`8001`"), encoding="utf-8")
    assert settings_doc.main(["--check", "--output", str(page)]) == 1
    assert settings_doc.main(["--output", str(page)]) == 0
    assert settings_doc.main(["--check", "--output", str(page)]) == 0
    assert page.read_text(encoding="utf-8") == _current_page()


@dataclass
class _Example:
    name: str = "x"  # what it is called

    # Sizes: how big things get.
    size: int = 4
    # Said above the field,
    # over two lines.
    limit: float | None = None  # and beside it (None: $EXAMPLE_LIMIT)
    tags: list = field(default_factory=lambda: ["a"], metadata={"env": "EXAMPLE_TAGS"})

    flag: bool = True  # a | b

    def method(self) -> int:  # not a setting
        return 1


def test_dataclass_help_sections_and_environment_come_from_the_source() -> None:
    sections = settings_doc.describe(_Example)
    assert [(s.title, [d.key for d in s.settings]) for s in sections] == [
        ("General", ["name"]), ("Sizes", ["size", "limit", "tags"]), ("Other", ["flag"])]
    sizes = sections[1]
    assert sizes.note == "Sizes: how big things get."
    size, limit, tags = sizes.settings
    assert size.help == "" and size.default == "4" and size.type == "int"
    assert limit.help == "Said above the field, over two lines. and beside it (None: $EXAMPLE_LIMIT)"
    assert limit.env == ("EXAMPLE_LIMIT",) and limit.default == "unset" and limit.type == "float | None"
    assert tags.env == ("EXAMPLE_TAGS",) and tags.default == '["a"]'
    page = settings_doc.render(_Example)
    assert "| `flag` | `bool` | `true` |  |  | a \\| b |" in page  # a pipe in the help does not split the row
    assert "`EXAMPLE_LIMIT`" in page


def test_a_pydantic_settings_class_is_read_from_its_fields() -> None:
    pydantic = pytest.importorskip("pydantic")
    pydantic_settings = pytest.importorskip("pydantic_settings")

    class Engine(pydantic.BaseModel):
        """How big the engine is."""
        kv_cache_gb: float = pydantic.Field(1.0, description="KV pool size in GiB")

    class Example(pydantic_settings.BaseSettings):
        model_config = pydantic_settings.SettingsConfigDict(env_prefix="EXAMPLE_", env_nested_delimiter="__")
        port: int = pydantic.Field(8000, description="port to listen on")
        secret: str | None = pydantic.Field(None, validation_alias="EXAMPLE_KEY", description="the key")
        engine: Engine = Engine()

    general, engine = settings_doc.describe(Example)
    port, secret = general.settings
    assert (port.key, port.type, port.default, port.env, port.help) == (
        "port", "int", "8000", ("EXAMPLE_PORT",), "port to listen on")
    assert secret.env == ("EXAMPLE_KEY",) and secret.default == "unset" and secret.type == "str | None"
    assert engine.title == "[engine]" and engine.note == "How big the engine is."
    (kv,) = engine.settings
    assert (kv.key, kv.default, kv.env) == ("engine.kv_cache_gb", "1.0", ("EXAMPLE_ENGINE__KV_CACHE_GB",))
