"""/v1/embeddings with the official `openai` package against a live server."""
from __future__ import annotations

import base64
import math
import struct

import openai
import pytest

MODEL = "tiny-random"


@pytest.fixture(scope="module")
def api_key(http, admin) -> str:
    return http.post("/auth/api-keys", headers=admin, json={"name": "sdk"}).json()["key"]


@pytest.fixture(scope="module")
def sdk(live, api_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=api_key, max_retries=0, timeout=30)


def _norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def _close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


def test_one_string_gives_one_unit_vector_with_usage(sdk, tiny_backend):
    r = sdk.embeddings.create(model=MODEL, input="The quick brown fox", encoding_format="float")
    assert r.object == "list" and r.model == MODEL and len(r.data) == 1
    assert r.data[0].object == "embedding" and r.data[0].index == 0
    vec = r.data[0].embedding
    assert len(vec) == tiny_backend.embedding_size() and abs(_norm(vec) - 1) < 1e-5
    tokens = len(tiny_backend.tokenizer.encode("The quick brown fox"))
    assert r.usage.prompt_tokens == tokens and r.usage.total_tokens == tokens


def test_batched_equals_one_by_one(sdk):
    texts = ["alpha beta", "a much longer sentence about retrieval and files " * 5, "x", "the end"]
    batched = sdk.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in batched.data] == [0, 1, 2, 3]
    for text, d in zip(texts, batched.data):
        alone = sdk.embeddings.create(model=MODEL, input=text, encoding_format="float").data[0].embedding
        assert _close(d.embedding, alone)
    assert not _close(batched.data[0].embedding, batched.data[3].embedding)


def test_token_ids_are_embedded_as_given(sdk, tiny_backend):
    ids = tiny_backend.tokenizer.encode("hello world")
    by_ids = sdk.embeddings.create(model=MODEL, input=[ids, ids[:1]], encoding_format="float")
    by_text = sdk.embeddings.create(model=MODEL, input="hello world", encoding_format="float")
    assert _close(by_ids.data[0].embedding, by_text.data[0].embedding)
    assert by_ids.usage.prompt_tokens == len(ids) + 1


def test_base64_is_little_endian_float32(sdk, live, api_key):
    floats = sdk.embeddings.create(model=MODEL, input="round trip", encoding_format="float").data[0].embedding
    raw = sdk.embeddings.create(model=MODEL, input="round trip", encoding_format="base64").data[0].embedding
    assert isinstance(raw, str)
    data = base64.b64decode(raw)
    decoded = list(struct.unpack(f"<{len(data) // 4}f", data))
    assert _close(decoded, floats, 1e-6)
    # The SDK's default asks for base64 and decodes it itself.
    assert _close(list(sdk.embeddings.create(model=MODEL, input="round trip").data[0].embedding), floats, 1e-6)


def test_dimensions_truncate_then_renormalize(sdk, tiny_backend):
    full = sdk.embeddings.create(model=MODEL, input="shorter please", encoding_format="float").data[0].embedding
    short = sdk.embeddings.create(model=MODEL, input="shorter please", dimensions=8,
                                  encoding_format="float").data[0].embedding
    assert len(short) == 8 and abs(_norm(short) - 1) < 1e-5
    n = _norm(full[:8])
    assert _close(short, [x / n for x in full[:8]])
    with pytest.raises(openai.BadRequestError) as err:
        sdk.embeddings.create(model=MODEL, input="too wide", dimensions=tiny_backend.embedding_size() + 1)
    assert err.value.body["param"] == "dimensions"


def test_bad_inputs_are_4xx(sdk):
    with pytest.raises(openai.BadRequestError, match="empty string"):
        sdk.embeddings.create(model=MODEL, input=["ok", ""])
    with pytest.raises(openai.BadRequestError):
        sdk.embeddings.create(model=MODEL, input=[])
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        sdk.embeddings.create(model=MODEL, input=[[10**9]])
    with pytest.raises(openai.BadRequestError, match="embeds at most"):
        sdk.embeddings.create(model=MODEL, input="word " * 5000)
    with pytest.raises(openai.NotFoundError):
        sdk.embeddings.create(model="no-such-model", input="x")


def test_no_kv_blocks_are_left_and_tokens_are_metered(sdk, http, api_key, tiny_backend):
    auth = {"Authorization": f"Bearer {api_key}"}
    before = http.get("/usage", headers=auth).json()
    r = sdk.embeddings.create(model=MODEL, input=["metered input one", "and two"], encoding_format="float")
    after = http.get("/usage", headers=auth).json()
    assert after["totals"]["prompt_tokens"] - before["totals"]["prompt_tokens"] == r.usage.prompt_tokens
    s = tiny_backend.engine.snapshot()
    assert s.kv_cache_free_blocks == s.kv_cache_blocks
    assert not tiny_backend.engine.engine.embedder.jobs
