"""The remote backend and the router against a real vLLM OpenAI server (runs only when one is given).

    vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --port 8000          # on a GPU host
    CHATLOOM_TEST_VLLM_URL=http://gpu-host:8000 \\
    CHATLOOM_TEST_VLLM_TOKENIZER=/path/to/SmolLM2-135M-Instruct \\     # optional: exact text checks
        pytest tests/serving/test_vllm.py

CI does not install vLLM; this file is skipped there. Pointing CHATLOOM_TEST_VLLM_URL at a
`chatloom replica` runs the same checks against chatloom's own server.
"""
from __future__ import annotations

import os

import pytest

from chatloom.serving.backend import GenerationRequest
from chatloom.serving.remote import RemoteBackend, ReplicaError
from chatloom.serving.router import Router, RouterConfig

URL = os.environ.get("CHATLOOM_TEST_VLLM_URL")
pytestmark = pytest.mark.skipif(not URL, reason="set CHATLOOM_TEST_VLLM_URL to a vLLM server to run")
CHAT = [{"role": "user", "content": "Write three sentences about the sea."}]


class DiesAfter(RemoteBackend):
    """The same server, but the connection 'dies' after `k` streamed pieces, as a crashed replica's would."""

    def __init__(self, url: str, model: str | None, k: int) -> None:
        super().__init__(url, model)
        self.k = k
        self.base_url = url.rstrip("/") + "#dies"  # its name in the router; requests still go to `url`

    async def stream_tokens(self, prompt_ids, params, request_id=None):
        n = 0
        async for piece in super().stream_tokens(prompt_ids, params, request_id):
            yield piece
            n += 1
            if n == self.k:
                raise ReplicaError(f"{self.base_url}: connection lost (simulated)")


def _tokenizer():
    spec = os.environ.get("CHATLOOM_TEST_VLLM_TOKENIZER")
    if not spec:
        return None
    from chatloom.models import load_tokenizer

    return load_tokenizer(spec)


async def _answer(backend, max_tokens=40):
    parts, last = [], None
    async for d in backend.stream(GenerationRequest(messages=CHAT, max_tokens=max_tokens, temperature=0)):
        parts.append(d.text)
        last = d
    return "".join(parts), last


async def test_chat_answer_from_vllm():
    client = RemoteBackend(URL, os.environ.get("CHATLOOM_TEST_VLLM_MODEL"))
    await client.start()
    try:
        text, last = await _answer(client)
        assert text.strip() and last.finished and last.completion_tokens > 0
        load = await client.load()
        assert load.num_requests_running is not None and load.kv_cache_usage_perc is not None
    finally:
        await client.close()


async def test_failover_mid_answer_through_vllm():
    probe = RemoteBackend(URL, os.environ.get("CHATLOOM_TEST_VLLM_MODEL"))
    model = (await probe.probe()).models[0] if probe.model is None else probe.model
    await probe.close()
    tok = _tokenizer()
    plain = Router(model, [URL], RouterConfig(policy="round_robin"), tok)
    await plain.start()
    try:
        expected, exp_last = await _answer(plain)
    finally:
        await plain.close()
    # Round robin sends the first request to the replica that dies after 5 pieces; the rest continues
    # on the healthy one from the prompt plus the tokens produced so far.
    router = Router(model, [DiesAfter(URL, model, 5), RemoteBackend(URL, model)], RouterConfig(policy="round_robin"), tok)
    await router.start()
    try:
        text, last = await _answer(router)
    finally:
        await router.close()
    assert router.failovers == 1 and last.failovers == 1
    assert last.completion_tokens == exp_last.completion_tokens
    if tok is not None:  # exact text needs the model's tokenizer here; without it the text is appended
        assert text == expected
    else:
        assert text.strip()
