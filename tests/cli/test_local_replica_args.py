"""The local replicas `chatloom serve --local-replicas` starts get the gateway's model flags."""
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
