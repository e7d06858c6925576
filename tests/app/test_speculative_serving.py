"""The service with speculative decoding on: the chat product and the OpenAI API answer
as they do without it, /metrics carries vLLM's spec_decode counters, and bad settings
are refused with a message naming them."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chatloom.app.core.settings import Settings
from chatloom.engine import EngineConfig
from chatloom.serving import LocalBackend

from app_testing import app_client, done_of, make_settings, new_conversation, send, tokens_of


async def test_serving_with_ngram_speculation(tmp_path, tiny_model_fp32):
    backend = LocalBackend(tiny_model_fp32, engine_config=EngineConfig(
        num_blocks=256, speculative="ngram", speculative_adaptive=False))
    settings = make_settings(tmp_path, speculative="ngram")
    quote = "abcabcabcabcabcabc " * 4
    async with app_client(settings, backend) as (client, app, alice):
        cid = await new_conversation(client, alice)
        _, events = await send(client, alice, cid, f"Repeat after me: {quote}", max_tokens=40)
        assert done_of(events)["usage"]["completion_tokens"] > 0 and tokens_of(events)
        body = {"model": "tiny-random", "messages": [{"role": "user", "content": quote}], "max_tokens": 40,
                "temperature": 0}
        r = await client.post("/v1/chat/completions", json=body, headers=alice)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0
        text = (await client.get("/metrics")).text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens"):
        assert f"vllm:spec_decode_{key}_total" in samples, key
    assert samples["vllm:spec_decode_num_draft_tokens_total"] > 0
    assert samples["vllm:spec_decode_num_emitted_tokens_total"] >= samples["vllm:spec_decode_num_accepted_tokens_total"]


@pytest.mark.parametrize("bad,match", [
    ({"speculative": "eagle"}, "speculative must be"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"speculative": "draft"}, "speculative_model"),
])
def test_bad_speculative_settings_are_named(tmp_path, bad, match):
    toml = tmp_path / "s.toml"
    toml.write_text("".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in bad.items()))
    with pytest.raises(ValueError, match=match):
        Settings.from_file(toml)
