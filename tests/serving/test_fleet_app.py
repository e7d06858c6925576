"""Several models through the app: [[models]] settings, /v1/models lists them, requests route by model."""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import pytest

from chatloom.app.core.fleet_settings import parse_fleet
from chatloom.app.main import create_app
from chatloom.settings import Settings

from fleet_testing import ReplicaProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_checkpoints import hf_config, random_weights, write_hf_folder  # noqa: E402


def served(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:request_success_total"))


@pytest.fixture(scope="module")
def hf_replica(tmp_path_factory):
    cfg = hf_config()
    folder = write_hf_folder(tmp_path_factory.mktemp("m") / "tiny-hf", cfg, random_weights(cfg))
    rep = ReplicaProcess(model=str(folder), num_blocks=256).launch().wait_ready()
    yield rep, folder
    rep.stop()


async def test_models_route_by_name_and_unknown_is_404(fleet, hf_replica, tmp_path):
    hf, folder = hf_replica
    settings = Settings(server={"data_dir": str(tmp_path)}, accounts={"jwt_secret": "test-secret-0123456789abcdef0123456789", "argon2_time_cost": 1, "argon2_memory_kib": 1024}, sampling={"temperature": 0.0}, fleet={"models": [{"id": "tiny-random", "replicas": [fleet[0].url]},
                                {"id": "tiny-hf", "replicas": [hf.url], "tokenizer": str(folder)}]})
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            for _ in range(100):
                if (await c.get("/readyz")).status_code == 200:
                    break
                await asyncio.sleep(0.1)
            r = await c.post("/auth/signup", json={"username": "alice", "password": "correct horse"})
            auth = {"Authorization": f"Bearer {r.json()['token']}"}
            models = (await c.get("/v1/models", headers=auth)).json()
            assert [m["id"] for m in models["data"]] == ["tiny-random", "tiny-hf"]
            for model, url in (("tiny-hf", hf.url), ("tiny-random", fleet[0].url)):
                before = served(url)
                r = await c.post("/v1/chat/completions", headers=auth, json={
                    "model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
                assert r.status_code == 200, r.text
                assert r.json()["model"] == model
                assert served(url) == before + 1
            r = await c.post("/v1/chat/completions", headers=auth, json={
                "model": "nope", "messages": [{"role": "user", "content": "hello"}]})
            assert r.status_code == 404 and "nope" in r.text


@pytest.mark.parametrize("models, replicas, policy, weights, message", [
    ([{"id": 3}], None, "prefix_aware", None, "models\\[0\\]: id must be a non-empty string"),
    ([{"id": "a", "replicas": "http://x"}], None, "prefix_aware", None, "replicas must be a list"),
    ([{"id": "a", "replicas": ["ftp://x"]}], None, "prefix_aware", None, "must look like http://host:port"),
    ([{"id": "a", "urls": []}], None, "prefix_aware", None, "unknown field\\(s\\) urls"),
    ([{"id": "a"}, {"id": "a"}], None, "prefix_aware", None, "a listed twice"),
    ([], None, "prefix_aware", None, "one or more"),
    ([{"id": "a", "replicas": ["http://x:1"]}], ["http://y:1"], "prefix_aware", None, "not both"),
    (None, ["http://y:1"], "fastest", None, "router_policy"),
    (None, ["http://y:1"], "least_load", {"prefix": "high"}, "router_weights.prefix"),
    ([{"id": "a", "pooling": "max"}], None, "prefix_aware", None, "pooling must be"),
])
def test_malformed_fleet_settings_are_one_line_errors(models, replicas, policy, weights, message):
    with pytest.raises(ValueError, match=message):
        parse_fleet(models, replicas, policy, weights, "m")


def test_replica_flag_serves_the_default_model_and_weights_are_read():
    fleet = parse_fleet(None, ["http://h:1/"], "least_load", {"prefix": 2, "balance_waiting": 8}, "/m/tiny.gguf")
    assert fleet.models[0].id == "tiny" and fleet.models[0].replicas == ("http://h:1",)
    assert fleet.weights.prefix == 2.0 and fleet.weights.extra == {"balance_waiting": 8.0}


def test_the_class_targets_setting_reaches_the_routers():
    from chatloom.app.core.fleet_settings import build_fleet_backend
    from chatloom.app.main import default_backend
    from chatloom.settings import Settings

    for on in (False, True):
        fleet = parse_fleet(None, ["http://h:1/"], "prefix_aware", None, "tiny-random", class_targets=on)
        assert build_fleet_backend(fleet, None).config.class_targets is on
    settings = Settings().with_values({"fleet.replicas": ["http://h:1/"], "fleet.router_class_targets": True})
    assert default_backend(settings).config.class_targets is True


def test_the_opening_gate_settings_reach_the_routers():
    from chatloom.app.main import default_backend

    settings = Settings().with_values({"fleet.replicas": ["http://h:1/"], "fleet.router_opening_limit": 5,
                                       "fleet.router_opening_hold_ms": 20})
    router = default_backend(settings)
    assert (router.config.opening_limit, router.config.opening_hold_s) == (5, 0.02)
    assert (router._opening.limit, router._opening.hold_s) == (5, 0.02)


def test_pooling_is_set_per_local_model():
    from chatloom.app.core.fleet_settings import build_fleet_backend
    from chatloom.serving import LocalBackend

    fleet = parse_fleet([{"id": "a", "path": "tiny-random", "pooling": "last"}, {"id": "b", "path": "tiny-random"}],
                        None, "prefix_aware", None, "m")
    backend = build_fleet_backend(fleet, lambda spec, pooling=None: LocalBackend(spec, pooling=pooling or "mean"))
    assert backend.backends["a"].pooling == "last" and backend.backends["b"].pooling == "mean"


def _running(url: str) -> float:
    try:
        text = httpx.get(url + "/metrics", timeout=2).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running"))


def test_sigkill_mid_answer_through_the_app_keeps_the_stream_whole(fleet, tmp_path):
    """A user's SSE stream survives its replica's death: ids contiguous, text as without the fault."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "app"))
    from app_testing import LiveServer, make_settings, parse_sse, tokens_of

    pair = fleet[1:]
    settings = make_settings(tmp_path, model={"name": "tiny-random"}, fleet={"replicas": [r.url for r in pair], "router_policy": "round_robin"}, sampling={"max_tokens": 1500, "max_tokens_limit": 1600})
    with LiveServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        for _ in range(200):
            if http.get("/readyz").status_code == 200:
                break
            time.sleep(0.1)
        r = http.post("/auth/signup", json={"username": "alice", "password": "correct horse"})
        auth = {"Authorization": f"Bearer {r.json()['token']}"}

        def ask() -> tuple[list, object]:
            cid = http.post("/conversations", headers=auth).json()["id"]
            return cid, http.stream("POST", f"/conversations/{cid}/messages", headers=auth,
                                    json={"text": "Tell me a long story about routers"})

        _, stream = ask()
        with stream as resp:
            expected = parse_sse(resp.read().decode())
        _, stream = ask()
        raw, killed = b"", None
        with stream as resp:
            for chunk in resp.iter_bytes():
                raw += chunk
                if killed is None and raw.count(b"\"token\"") >= 10:
                    killed = next(rep for rep in pair if _running(rep.url) > 0)
                    killed.kill()
        got = parse_sse(raw.decode())
    try:
        assert killed is not None
        ids = [int(e.id) for e in got if e.id is not None]
        assert ids == list(range(ids[0], ids[0] + len(ids)))  # contiguous: nothing lost, nothing twice
        assert tokens_of(got) == tokens_of(expected) and len(tokens_of(got)) > 0
        done = [e.data for e in got if isinstance(e.data, dict) and e.data.get("done")]
        assert done and "error" not in str(done[0]).lower()
    finally:
        killed and killed.launch().wait_ready()
