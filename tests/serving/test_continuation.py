"""Continuation text: after a failover, the text decoded from all the answer's tokens equals one run's."""
from chatloom.engine.detokenizer import IncrementalDetokenizer
from chatloom.engine.sampling_params import SamplingParams
from chatloom.serving.continuation import AnswerProgress


def one_run_text(tok, ids):
    d = IncrementalDetokenizer(tok)
    for t in ids:
        d.add(t)
    d.flush()
    return d.text


def test_text_after_failover_has_no_gap_and_no_repeat(tiny_tokenizer):
    ids = tiny_tokenizer.encode("héllo wörld, über alles ✓ and more text")
    want = one_run_text(tiny_tokenizer, ids)
    for cut in range(1, len(ids)):
        a = AnswerProgress(SamplingParams(max_tokens=100), tiny_tokenizer)
        d = IncrementalDetokenizer(tiny_tokenizer)
        sent = ""
        for t in ids[:cut]:  # what the first replica streamed: its own deltas (held-back bytes unsent)
            before = d.text
            d.add(t)
            sent += a.add([t], d.text[len(before):], False)
        a.failed_over()
        for i, t in enumerate(ids[cut:]):
            sent += a.add([t], "?", cut + i == len(ids) - 1)
        assert sent == want, cut


def test_stop_string_spanning_the_failover_point_is_found(tiny_tokenizer):
    ids = tiny_tokenizer.encode("abc STOP def")
    a = AnswerProgress(SamplingParams(max_tokens=100, stop=["STOP"]), tiny_tokenizer)
    sent = a.add(ids[:6], "abc", False)  # the first replica held back " ST" (a possible stop start)
    a.failed_over()
    sent += a.add(ids[6:], "OP def", True)
    assert a.stopped and sent == "abc "


def test_remaining_budget_and_a_finished_answer(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_ids[0]
    a = AnswerProgress(SamplingParams(max_tokens=10, min_tokens=4), tiny_tokenizer)
    a.add([1, 2, 3], "", False)
    rest = a.remaining_params()
    assert rest.max_tokens == 7 and rest.min_tokens == 1
    a.add([4, eos], "", False)
    assert a.remaining_params() is None and a.natural_finish() == "stop"
    b = AnswerProgress(SamplingParams(max_tokens=2), tiny_tokenizer)
    b.add([1, 2], "", False)
    assert b.remaining_params() is None and b.natural_finish() == "length"


async def test_local_backend_resumes_an_answer_begun_elsewhere(tiny_model_fp32):
    """What a gateway taking over a dead one's job does: the rest of the answer, text and counts whole."""
    from chatloom.engine import EngineConfig
    from chatloom.serving import GenerationRequest, LocalBackend

    backend = LocalBackend(tiny_model_fp32, engine_config=EngineConfig(num_blocks=128))
    await backend.start()
    try:
        req = dict(prompt="once upon a time", max_tokens=40, temperature=0)
        full = [d async for d in backend.stream(GenerationRequest(**req))]
        ids = [t for d in full for t in d.token_ids]
        assert len(ids) == 40 == full[-1].completion_tokens
        text = "".join(d.text for d in full)
        for cut in (1, 17, 39):
            sent = IncrementalDetokenizer(backend.tokenizer)
            for t in ids[:cut]:
                sent.add(t)
            rest = [d async for d in backend.stream(GenerationRequest(**req, resume_token_ids=ids[:cut],
                                                                      resume_text=sent.text))]
            assert sent.text + "".join(d.text for d in rest) == text
            assert [t for d in rest for t in d.token_ids] == ids[cut:]
            assert rest[-1].completion_tokens == 40 and rest[-1].finish_reason == "length"
    finally:
        await backend.close()
