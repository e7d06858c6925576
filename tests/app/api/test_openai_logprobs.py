"""Log probabilities on the OpenAI-compatible API, with the official `openai` package: chat's
`logprobs`/`top_logprobs` and completions' `logprobs` with `echo`, streamed and not, in OpenAI's shapes."""
from __future__ import annotations

import math

import openai
import pytest

MODEL = "tiny-random"
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def sdk(live, http, admin) -> openai.OpenAI:
    key = http.post("/auth/api-keys", headers=admin, json={"name": "sdk"}).json()["key"]
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0, timeout=30)


def _check_entry(e, k: int) -> None:
    assert isinstance(e.token, str) and e.logprob <= 0
    assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
    assert len(e.top_logprobs) == k
    assert all(a.logprob >= b.logprob for a, b in zip(e.top_logprobs, e.top_logprobs[1:]))
    assert sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1 + 1e-6


def test_chat_logprobs_with_greedy_top_entries(sdk):
    r = sdk.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0, logprobs=True,
                                    top_logprobs=3)
    choice = r.choices[0]
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for e in content:
        _check_entry(e, 3)
        # temperature 0: the token is the likeliest one, so it is the first top entry
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
    # (the bytes spell the answer's text: tests/models/test_token_bytes.py, on a real tokenizer; the random
    # model here writes broken characters)


def test_chat_logprobs_streamed_are_the_same(sdk):
    whole = sdk.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0, logprobs=True,
                                        top_logprobs=2)
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0,
                                              logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole.choices[0].logprobs.content]
    assert [[t.token for t in e.top_logprobs] for e in streamed] == \
        [[t.token for t in e.top_logprobs] for e in whole.choices[0].logprobs.content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content


def test_chat_without_logprobs_has_none(sdk):
    r = sdk.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, temperature=0)
    assert r.choices[0].logprobs is None
    r = sdk.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, temperature=0, logprobs=True)
    assert len(r.choices[0].logprobs.content) == 3 and all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)


def _check_completion_logprobs(lp, k: int, echo_tokens: int = 0) -> None:
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for i, (token, logprob, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
        if echo_tokens and i == 0:
            assert logprob is None and top is None
            continue
        assert logprob <= 0 and token in top and top[token] == logprob and len(top) <= k + 1
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-6


def test_completion_logprobs(sdk):
    r = sdk.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2)
    choice = r.choices[0]
    _check_completion_logprobs(choice.logprobs, 2)
    assert len(choice.logprobs.tokens) == r.usage.completion_tokens == 6
    # greedy: the chosen token is the likeliest
    assert all(max(top, key=top.get) == tok for tok, top in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs))
    chunks = list(sdk.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                         logprobs=2, stream=True))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == choice.logprobs.tokens and offsets == choice.logprobs.text_offset


def test_completion_echo_with_logprobs(sdk):
    prompt = "The cat sat"
    r = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=1, echo=True)
    choice = r.choices[0]
    assert choice.text.startswith(prompt)
    _check_completion_logprobs(choice.logprobs, 1, echo_tokens=r.usage.prompt_tokens)
    assert "".join(choice.logprobs.tokens[:r.usage.prompt_tokens]) == prompt
    assert len(choice.logprobs.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=1,
                                         echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == choice.logprobs.token_logprobs and streamed[0] is None
    # echo alone: the prompt's text, no logprobs
    plain = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None
    chunks = list(sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                         n=2, stream=True))
    for index in (0, 1):
        assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index) == choice.text


def test_echo_of_token_ids(sdk):
    r = sdk.completions.create(model=MODEL, prompt=[40, 41, 42, 43], max_tokens=2, temperature=0, logprobs=0,
                               echo=True)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 6 and lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])


@pytest.mark.parametrize("call,param", [
    (lambda sdk: sdk.chat.completions.create(model=MODEL, messages=HELLO, logprobs=True, top_logprobs=21),
     "top_logprobs"),
    (lambda sdk: sdk.chat.completions.create(model=MODEL, messages=HELLO, top_logprobs=2), "top_logprobs"),
    (lambda sdk: sdk.completions.create(model=MODEL, prompt="hi", logprobs=6), "logprobs"),
], ids=["top_logprobs_above_20", "top_logprobs_without_logprobs", "completion_logprobs_above_5"])
def test_too_many_alternatives_are_refused(sdk, call, param):
    with pytest.raises(openai.BadRequestError) as e:
        call(sdk)
    assert e.value.body["param"] == param and param in e.value.message


async def test_a_remote_backend_passes_logprobs_and_choices_through(live, http, admin):
    from chatloom.serving import GenerationRequest, RemoteBackend

    key = http.post("/auth/api-keys", headers=admin, json={"name": "remote"}).json()["key"]
    # This gateway is the "remote server" (chat answers go to its /v1/chat/completions).
    remote = RemoteBackend(live.url, MODEL, api_key=key)
    try:
        await remote.start()
        request = GenerationRequest(messages=HELLO, max_tokens=5, temperature=1.0, seed=3, n=2, logprobs=2)
        deltas = [d async for d in remote.stream(request)]
        assert sorted(d.index for d in deltas if d.finished) == [0, 1]
        for index in (0, 1):
            entries = [e for d in deltas if d.index == index for e in d.logprobs or []]
            assert len(entries) == 5 and all(len(e.top) == 2 and e.bytes is not None for e in entries)
        assert sum(d.completion_tokens for d in deltas if d.finished) == 10
    finally:
        await remote.close()


def test_completion_logprobs_from_a_remote_server_are_read():
    from chatloom.serving.remote import completion_logprobs

    block = {"tokens": [" a", " b"], "token_logprobs": [-0.5, -1.0], "text_offset": [0, 2],
             "top_logprobs": [{" a": -0.5, " c": -2.0}, {" d": -0.9, " b": -1.0}]}
    entries = completion_logprobs(block)
    assert [(e.token, e.logprob) for e in entries] == [(" a", -0.5), (" b", -1.0)]
    assert [[t.token for t in e.top] for e in entries] == [[" a", " c"], [" d", " b"]]
