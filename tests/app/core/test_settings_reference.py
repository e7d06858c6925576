"""The configuration reference page is generated from the settings tree and must not drift from it."""
from __future__ import annotations

from pathlib import Path

from chatloom.app.core import settings_reference
from chatloom.settings import Settings

PAGE = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def test_the_configuration_page_is_what_the_generator_writes_now() -> None:
    assert PAGE.is_file(), f"docs/configuration.md is missing: run `{settings_reference.COMMAND}`"
    assert PAGE.read_text(encoding="utf-8") == settings_reference.render(), (
        f"docs/configuration.md differs from the settings: run `{settings_reference.COMMAND}`")


def test_every_setting_has_a_row_with_its_default_and_environment_variable() -> None:
    page = settings_reference.render()
    for group, field in Settings.model_fields.items():
        assert f"## [{group}]" in page
        for name, sub in field.annotation.model_fields.items():
            row = f"| `{name}` | `{settings_reference.format_type(sub.annotation)}` | " \
                  f"`{settings_reference.format_default(sub.get_default(call_default_factory=True))}` | `CHATLOOM_{group.upper()}__{name.upper()}` |"
            assert row in page, row


def test_serve_flags_point_at_settings_that_exist() -> None:
    flags = settings_reference.serve_flags()
    assert flags["engine.kv_cache_gb"] == "--kv-cache-gb" and flags["server.db_url"] == "--db"
    for key in flags:
        group, name = key.split(".")
        assert name in Settings.model_fields[group].annotation.model_fields, key


def test_check_mode_fails_on_a_stale_page(tmp_path) -> None:
    page = tmp_path / "configuration.md"
    assert settings_reference.main(["--output", str(page)]) == 0
    assert settings_reference.main(["--output", str(page), "--check"]) == 0
    page.write_text(page.read_text().replace("`64`", "`65`"))
    assert settings_reference.main(["--output", str(page), "--check"]) == 1
