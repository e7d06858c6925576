"""The CLI, the REST API, the OpenAI API and the engine take their sampling and size defaults from
one place, the settings tree: change it there and every front follows."""
from __future__ import annotations

import pytest

from chatloom.engine import EngineConfig, SamplingParams
from chatloom.serving import GenerationRequest
from chatloom.settings import DEFAULTS, Settings

from app_testing import app_client, make_settings, new_conversation, send
from traffic_testing import ScriptedBackend


def test_the_engine_and_the_backend_request_default_to_the_tree():
    sampling = DEFAULTS.sampling
    params, request = SamplingParams(), GenerationRequest()
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == \
        (sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_tokens)
    assert (request.temperature, request.top_p, request.top_k, request.max_tokens) == \
        (sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_tokens)
    engine, config = DEFAULTS.engine, EngineConfig()
    assert (config.kv_cache_gb, config.max_num_seqs, config.max_num_batched_tokens, config.block_size,
            config.kv_cache_dtype, config.max_model_len) == \
        (engine.kv_cache_gb, engine.max_num_seqs, engine.max_num_batched_tokens, engine.block_size,
         engine.kv_cache_dtype, engine.context_window)


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_the_cli_defaults_are_the_trees_and_follow_the_environment(command, monkeypatch):
    from chatloom.cli.main import build_parser

    args = build_parser().parse_args([command] + (["hi"] if command == "generate" else []))
    sampling = DEFAULTS.sampling
    assert (args.temperature, args.top_p, args.top_k, args.max_tokens) == \
        (sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_tokens)
    monkeypatch.setenv("CHATLOOM_SAMPLING__TEMPERATURE", "0.25")
    monkeypatch.setenv("CHATLOOM_SAMPLING__MAX_TOKENS", "33")
    args = build_parser().parse_args([command] + (["hi"] if command == "generate" else []))
    assert (args.temperature, args.max_tokens) == (0.25, 33)


async def test_rest_and_openai_requests_that_leave_sampling_out_get_the_settings(tmp_path):
    backend = ScriptedBackend()
    settings = make_settings(tmp_path, sampling={"temperature": 0.3, "top_p": 0.8, "max_tokens": 12})
    async with app_client(settings, backend) as (client, app, alice):
        cid = await new_conversation(client, alice)
        await send(client, alice, cid, "hello")
        r = await client.post("/v1/chat/completions", headers=alice,
                              json={"model": "scripted", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        r = await client.post("/v1/completions", headers=alice, json={"model": "scripted", "prompt": "hi"})
        assert r.status_code == 200, r.text
    rest, chat, completion = backend.requests[-3:]
    for request in (rest, chat, completion):
        assert (request.temperature, request.top_p, request.max_tokens) == (0.3, 0.8, 12), request
    assert Settings().sampling == DEFAULTS.sampling  # and nothing above changed the defaults themselves
