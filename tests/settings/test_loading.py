"""The settings tree: where values come from, in which order, and one-line errors."""
from __future__ import annotations

import pytest

from chatloom.settings import DEFAULTS, Settings, SettingsError, load_settings


@pytest.fixture(autouse=True)
def _no_settings_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("CHATLOOM_") and "__" in name:
            monkeypatch.delenv(name)


def test_defaults_file_environment_flags_in_that_order(tmp_path, monkeypatch):
    path = tmp_path / "c.toml"
    path.write_text("[engine]\nmax_num_seqs = 5\nkv_cache_gb = 2.0\nnum_blocks = 100\n[server]\nport = 9001\n")
    assert load_settings().engine.max_num_seqs == DEFAULTS.engine.max_num_seqs == 64
    s = load_settings(path)
    assert (s.engine.max_num_seqs, s.engine.kv_cache_gb, s.engine.num_blocks, s.server.port) == (5, 2.0, 100, 9001)
    monkeypatch.setenv("CHATLOOM_ENGINE__MAX_NUM_SEQS", "7")
    monkeypatch.setenv("CHATLOOM_ENGINE__KV_CACHE_GB", "3")
    s = load_settings(path)
    assert (s.engine.max_num_seqs, s.engine.kv_cache_gb, s.engine.num_blocks) == (7, 3.0, 100)  # env over the file
    s = load_settings(path, {"engine.max_num_seqs": 9, "engine.kv_cache_gb": None})
    assert (s.engine.max_num_seqs, s.engine.kv_cache_gb) == (9, 3.0)  # a flag over both; an absent flag is None
    assert s.server.port == 9001 and s.engine.block_size == DEFAULTS.engine.block_size  # untouched keys keep theirs


@pytest.mark.parametrize("toml,words", [
    ("[engine]\nmax_num_seq = 5\n", "unknown setting engine.max_num_seq"),
    ("[engin]\nmax_num_seqs = 5\n", "unknown settings group [engin]"),
    ('[engine]\nmax_num_seqs = "5"\n', "setting engine.max_num_seqs: input should be a valid integer, not '5'"),
    ("[engine]\nmax_num_seqs = 0\n", "setting engine.max_num_seqs: input should be greater than 0"),
    ('[engine]\nspeculative = "draft"\n', "speculative = draft needs speculative_model"),
    ("engine = 3\n", "engine is outside any table"),
    ('db_url = "sqlite://"\n', "db_url is outside any table: settings go in [group] tables (server, "),
    ('db_url = "sqlite://"\n', "it belongs in [server]"),
])
def test_a_bad_file_is_one_line_naming_the_key(tmp_path, toml, words):
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(SettingsError) as err:
        load_settings(path)
    assert words in str(err.value) and "\n" not in str(err.value)
    assert str(path) in str(err.value)


def test_a_bad_environment_variable_or_flag_is_named(monkeypatch):
    monkeypatch.setenv("CHATLOOM_SAMPLING__TEMPERATURE", "hot")
    with pytest.raises(SettingsError, match="environment variable CHATLOOM_SAMPLING__TEMPERATURE: setting "
                                            "sampling.temperature: input should be a valid number"):
        load_settings()
    monkeypatch.delenv("CHATLOOM_SAMPLING__TEMPERATURE")
    monkeypatch.setenv("CHATLOOM_SAMPLING__TEMPERATUR", "1")
    with pytest.raises(SettingsError, match="unknown setting sampling.temperatur"):
        load_settings()
    monkeypatch.delenv("CHATLOOM_SAMPLING__TEMPERATUR")
    with pytest.raises(SettingsError, match="command line: setting engine.max_num_seqs"):
        load_settings(flags={"engine.max_num_seqs": -1})
    with pytest.raises(SettingsError, match="unknown setting 'engine.nope'"):
        load_settings(flags={"engine.nope": 1})


def test_list_and_table_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("CHATLOOM_FLEET__REPLICAS", '["http://a:1", "http://b:2"]')
    monkeypatch.setenv("CHATLOOM_FLEET__ROUTER_WEIGHTS", '{"prefix": 2.0}')
    s = load_settings()
    assert s.fleet.replicas == ["http://a:1", "http://b:2"] and s.fleet.router_weights == {"prefix": 2.0}


def test_with_values_changes_dotted_keys_and_checks_them():
    s = Settings().with_values({"fleet.replicas": ["http://x:1"], "engine.max_num_seqs": None})
    assert s.fleet.replicas == ["http://x:1"] and s.engine.max_num_seqs == DEFAULTS.engine.max_num_seqs
    with pytest.raises(SettingsError, match="unknown setting 'fleet.replica'"):
        Settings().with_values({"fleet.replica": []})


def test_every_setting_has_a_description():
    missing = [f"{group}.{name}" for group, field in Settings.model_fields.items()
               for name, sub in field.annotation.model_fields.items() if not sub.description]
    assert missing == []
