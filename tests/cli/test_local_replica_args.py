"""The local replicas `chatloom serve --local-replicas` starts get the gateway's model and engine settings."""
from __future__ import annotations

import argparse

import pytest

from chatloom.cli import fleet
from chatloom.cli.replica import register
from chatloom.settings import DEFAULTS


def _replica_argv(monkeypatch, settings) -> list[str]:
    """The flags fleet_for_serve hands its LocalReplicas, caught before any process starts."""
    seen: list[list[str]] = []

    class FakeReplicas:
        def __init__(self, model, count, threads, extra):
            seen.append([model, *extra])

        def start(self):
            raise RuntimeError("caught before any process starts")

    monkeypatch.setattr("chatloom.serving.local_fleet.LocalReplicas", FakeReplicas)
    args = argparse.Namespace(router_policy=None, replica=None, local_replicas=2, replica_threads=1)
    with pytest.raises(ValueError, match="caught before"):
        with fleet.fleet_for_serve(settings, args):
            pass
    return seen[0]


def _parse_as_replica(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["replica", "--model", *argv])


def test_mmproj_reaches_every_local_replica(monkeypatch, tmp_path):
    projector = tmp_path / "mmproj.gguf"
    projector.write_bytes(b"GGUF")
    settings = DEFAULTS.with_values({"model.name": str(tmp_path / "decoder.gguf"), "model.mmproj": str(projector),
                                     "engine.max_num_batched_tokens": 256})
    argv = _replica_argv(monkeypatch, settings)
    args = _parse_as_replica(argv)
    assert args.mmproj == str(projector.resolve())
    assert args.model == str(tmp_path / "decoder.gguf") and args.max_num_batched_tokens == 256


def test_no_mmproj_flag_without_a_projector(monkeypatch):
    argv = _replica_argv(monkeypatch, DEFAULTS)
    assert "--mmproj" not in argv and _parse_as_replica(argv).mmproj is None


class StartedReplicas:
    """LocalReplicas as far as fleet_for_serve sees them, with no process behind the URLs."""

    def __init__(self, model, count, threads, extra):
        self.urls = [f"http://127.0.0.1:{9100 + i}" for i in range(count)]

    def start(self):
        return self.urls

    def stop(self):
        pass


def _serve_with_local_replicas(monkeypatch, settings):
    async def no_probe(_fleet):
        pass

    monkeypatch.setattr("chatloom.serving.local_fleet.LocalReplicas", StartedReplicas)
    monkeypatch.setattr(fleet, "_probe", no_probe)
    args = argparse.Namespace(router_policy=None, replica=None, local_replicas=2, replica_threads=1)
    return fleet.fleet_for_serve(settings, args)


def test_local_replicas_serve_the_default_model_beside_the_configured_ones(monkeypatch):
    small = {"id": "tiny-small", "path": "tiny-random"}
    settings = DEFAULTS.with_values({"model.name": "tiny-random", "fleet.models": [small]})
    with _serve_with_local_replicas(monkeypatch, settings) as (served, local):
        assert served.fleet.models == [{"id": "tiny-random", "path": "tiny-random", "replicas": local.urls}, small]
        assert not served.fleet.replicas


def test_a_configured_model_named_like_the_local_replicas_one_is_refused(monkeypatch):
    settings = DEFAULTS.with_values({"model.name": "tiny-random", "fleet.models": [{"id": "tiny-random"}]})
    with pytest.raises(ValueError, match="the model the local replicas serve"):
        with _serve_with_local_replicas(monkeypatch, settings):
            pass


def test_encoder_and_matmul_settings_reach_every_local_replica(monkeypatch, tmp_path):
    from chatloom.cli.replica import engine_config
    from chatloom.model_args import bf16_matmul, int8_matmul
    from chatloom.settings import load_settings

    # The gateway's file turns the int8 switch off and the bf16 one on; its environment sets the encoder.
    config = tmp_path / "chatloom.toml"
    config.write_text("[model]\nint8_matmul = false\nbf16_matmul = true\n[engine]\nencoder_cache_mb = 48.5\n")
    monkeypatch.setenv("CHATLOOM_ENGINE__ENCODER_MAX_SLOWDOWN", "0.35")
    argv = _replica_argv(monkeypatch, load_settings(config))
    # A replica's own environment says otherwise: the gateway's settings, passed as flags, win.
    monkeypatch.setenv("CHATLOOM_MODEL__INT8_MATMUL", "true")
    monkeypatch.setenv("CHATLOOM_MODEL__BF16_MATMUL", "false")
    args = _parse_as_replica(argv)
    assert int8_matmul(args.int8_matmul) is False and bf16_matmul(args.bf16_matmul) is True
    engine = engine_config(args)
    assert engine.encoder_cache_mb == 48.5 and engine.encoder_max_slowdown == 0.35


def test_matmul_switches_on_and_unset_reach_the_replicas(monkeypatch):
    settings = DEFAULTS.with_values({"model.int8_matmul": True, "engine.encoder_max_slowdown": float("inf")})
    args = _parse_as_replica(_replica_argv(monkeypatch, settings))
    assert args.int8_matmul is True and args.bf16_matmul is False and args.encoder_max_slowdown == float("inf")
    args = _parse_as_replica(_replica_argv(monkeypatch, DEFAULTS))
    assert args.int8_matmul is None  # unset: the replica decides by the file, as the gateway would


def test_a_replica_left_without_encoder_flags_keeps_the_engines_defaults():
    from chatloom.cli.replica import engine_config
    from chatloom.engine import EngineConfig

    engine = engine_config(_parse_as_replica(["tiny-random"]))
    assert engine.encoder_cache_mb == EngineConfig().encoder_cache_mb
    assert engine.encoder_max_slowdown == EngineConfig().encoder_max_slowdown


@pytest.mark.parametrize("flag, value", [("--encoder-cache-mb", "-1"), ("--encoder-max-slowdown", "nan"),
                                         ("--encoder-max-slowdown", "-0.5")])
def test_bad_encoder_flags_are_refused(flag, value, capsys):
    with pytest.raises(SystemExit):
        _parse_as_replica(["tiny-random", flag, value])
    assert flag in capsys.readouterr().err
