"""The bundled model's tokenizer (built from GGUF metadata) and chat template."""
from __future__ import annotations

import pytest

from chatloom.models import ModelError
from chatloom.models.chat_template import render_chat

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "digits 1234567890 and 3.14159",
    "unicode: héllo wörld, naïve café, 日本語, emoji 🙂👍🏽",
    "code: def f(x):\n    return {'a': [x, x ** 2]}",
    "",
]


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_are_single_tokens(tok):
    im_start, im_end = tok.encode("<|im_start|>"), tok.encode("<|im_end|>")
    assert len(im_start) == 1 and len(im_end) == 1
    assert im_end[0] in tok.eos_token_ids
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert not tok.add_bos  # SmolLM2's template writes its own markers
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == im_start[0] and ids[-1] == im_end[0]
    # Special tokens are dropped when decoding for the user, kept on request.
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special=False) == "<|im_start|>user\nhi<|im_end|>"


def test_digits_are_split(tok):
    # SmolLM2's pre-tokenizer ("smollm") splits numbers into single digits.
    ids = tok.encode("2024")
    assert [tok.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_chat_template_renders(tok):
    assert tok.chat_template and "im_start" in tok.chat_template
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = render_chat(tok.chat_template, messages, bos_token=tok.bos_token, eos_token=tok.eos_token)
    # SmolLM2's template adds its default system prompt when none is given.
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    with_system = render_chat(tok.chat_template, [{"role": "system", "content": "Be brief."}] + messages)
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    no_prompt = render_chat(tok.chat_template, messages, add_generation_prompt=False)
    assert no_prompt.endswith("<|im_end|>\n")
    turns = messages + [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Italy?"}]
    multi = render_chat(tok.chat_template, turns)
    assert "<|im_start|>assistant\nParis.<|im_end|>\n<|im_start|>user\nAnd Italy?" in multi


def test_broken_template_is_a_model_error():
    with pytest.raises(ModelError, match="chat template"):
        render_chat("{% if %}", [{"role": "user", "content": "x"}])
    with pytest.raises(ModelError, match="no system"):
        render_chat("{{ raise_exception('no system') }}", [])


def test_fallback_template_when_model_has_none():
    text = render_chat(None, [{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_long_text_gives_the_same_ids_without_holding_the_gil(tok):
    """From _GIL_FREE_CHARS on, encode goes through encode_batch (which lets other threads run: see
    tests/app/core/test_edge_validation.py); the ids must be what the single call gives."""
    import threading
    import time

    from chatloom.models.tokenizer import _GIL_FREE_CHARS

    text = " ".join(TEXTS) * (2 * _GIL_FREE_CHARS // len(" ".join(TEXTS)) + 1)
    assert len(text) >= _GIL_FREE_CHARS
    assert tok.encode(text) == tok.tokenizer.encode(text, add_special_tokens=False).ids
    # Another thread keeps getting turns while a long text is encoded.
    big = "w" * 600_000
    ticks, done = [], threading.Event()

    def tick():
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.002)

    t = threading.Thread(target=tick)
    t.start()
    time.sleep(0.01)
    start = time.monotonic()
    tok.encode(big)
    took = time.monotonic() - start
    done.set()
    t.join()
    during = [b for b in ticks if start <= b <= start + took]
    assert len(during) >= 3, (took, len(during))
