"""Constrained decoding in the engine: a random-weight model with the real SmolLM2 tokenizer, so the
masks are over the real 49k vocabulary while the model itself would write anything at all."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from chatloom.engine import EngineConfig, InvalidRequest, LLMEngine, SamplingParams
from chatloom.engine.structured.constraint import Constraint, ConstraintError
from chatloom.engine.structured.guide import bitmask_to_bool
from chatloom.models.gguf_loader import open_gguf
from chatloom.models.loader import LoadedModel
from chatloom.models.registry import smollm2_path, tiny_random_config
from chatloom.models.tokenizer import from_gguf
from chatloom.models.weights import random_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", None]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny_smol() -> LoadedModel:
    tok = from_gguf(open_gguf(smollm2_path()))
    cfg = tiny_random_config()
    cfg.vocab_size = tok.vocab_size
    return LoadedModel("tiny-smol", random_model(cfg, torch.float32), tok, cfg)


@pytest.fixture(scope="module")
def engine(tiny_smol) -> LLMEngine:
    return LLMEngine(tiny_smol, EngineConfig(num_blocks=512, max_num_seqs=64, seed=0))


def sampled(constraint: Constraint | None, seed: int, max_tokens: int = 120, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, constraint=constraint, **kw)


def test_bitmask_unpacks_bit_by_bit():
    words = torch.tensor([[0b101, -1]], dtype=torch.int32)  # tokens 0 and 2; then all 32 of word 1
    allowed = bitmask_to_bool(words, 70)
    assert allowed.shape == (1, 70)
    assert allowed[0, :3].tolist() == [True, False, True]
    assert allowed[0, 32:64].all() and not allowed[0, 64:].any() and not allowed[0, 3:32].any()


def test_json_schema_always_parses_and_validates_in_a_mixed_batch(engine):
    # 12 constrained and 4 free requests share every step.
    prompts = ["Describe a person:"] * 16
    params = [sampled(Constraint.json_schema(PERSON) if i % 4 else None, seed=i) for i in range(16)]
    outs = engine.generate(prompts, params, use_tqdm=False)
    free_texts = []
    for i, out in enumerate(outs):
        if i % 4 == 0:
            free_texts.append(out.text)
            continue
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
    # The free rows were not masked: a random model over 49k tokens does not write JSON.
    assert not any(t.lstrip().startswith('{"name"') for t in free_texts)
    assert engine.guide.stats.rows > 0 and len(engine.guide) == 0  # matchers dropped at the end


def test_json_object_mode_gives_an_object(engine):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9, "minimum": 0}},
              "required": ["a"], "additionalProperties": False}
    # json mode alone on a random model may run long; the structure is checked on every prefix instead.
    out = engine.generate(["x"], [sampled(Constraint.json_object(), seed=1, max_tokens=40)], use_tqdm=False)[0]
    assert out.text.lstrip().startswith("{")
    out = engine.generate(["x"], [sampled(Constraint.json_schema(schema), seed=1)], use_tqdm=False)[0]
    assert isinstance(json.loads(out.text)["a"], int)


def test_regex_and_choice(engine):
    pattern = r"[0-9]{3}-[a-z]{2}"
    outs = engine.generate(["a", "b"], [sampled(Constraint.regex(pattern), seed=s) for s in (1, 2)], use_tqdm=False)
    for out in outs:
        assert re.fullmatch(pattern, out.text), out.text
    options = ["yes", "no", "maybe later"]
    outs = engine.generate(["q"] * 6, [sampled(Constraint.choice(options), seed=s) for s in range(6)], use_tqdm=False)
    assert all(o.text in options and o.finish_reason == "stop" for o in outs)


def test_greedy_constrained_matches_greedy_masked_by_hand(engine, tiny_smol):
    # The mask only removes tokens: greedy constrained output = argmax over allowed tokens each step.
    out = engine.generate(["z"], [SamplingParams(max_tokens=5, temperature=0, constraint=Constraint.regex("[a-c]{5}"))],
                          use_tqdm=False)[0]
    assert re.fullmatch("[a-c]{5}", out.text)


def test_bad_constraints_are_refused_with_the_reason(engine):
    with pytest.raises(InvalidRequest, match="Invalid type"):
        SamplingParams(constraint=Constraint.json_schema({"type": "strin"}))
    with pytest.raises(InvalidRequest, match="unclosed group"):
        SamplingParams(constraint=Constraint.regex("a(b"))
    with pytest.raises(ConstraintError, match="non-empty strings"):
        Constraint.choice([]).check()
    # The engine keeps serving after a refused request.
    out = engine.generate(["x"], [SamplingParams(max_tokens=3, temperature=0)], use_tqdm=False)[0]
    assert out.num_output_tokens == 3


@pytest.mark.slow
def test_real_model_answers_in_the_schema(smollm2):
    from chatloom.models.chat_template import encode_chat

    engine = LLMEngine(smollm2, EngineConfig(num_blocks=256, max_num_seqs=4))
    prompt = encode_chat(smollm2.tokenizer, [{"role": "user", "content": "Give a person's name and age as JSON."}])
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 130}},
              "required": ["name", "age"], "additionalProperties": False}
    outs = engine.generate([prompt] * 2, [SamplingParams(max_tokens=40, temperature=0, constraint=Constraint.json_schema(schema)),
                                          SamplingParams(max_tokens=8, temperature=0)], use_tqdm=False)
    jsonschema.validate(json.loads(outs[0].text), schema)
    assert outs[0].finish_reason == "stop"
    assert not outs[1].text.lstrip().startswith('{"name"')  # the free request beside it is not masked


def test_constrained_requests_never_speculate_and_stay_valid_beside_speculating_ones(tiny_smol):
    # Speculative decoding on: the free greedy rows propose (a repeating prompt) and must match a plain
    # engine; the constrained rows get one masked row per step, so their output still fits the grammar.
    config = dict(num_blocks=512, max_num_seqs=16, seed=0)
    spec = LLMEngine(tiny_smol, EngineConfig(speculative="ngram", speculative_adaptive=False,
                                             num_speculative_tokens=4, **config))
    plain = LLMEngine(tiny_smol, EngineConfig(**config))
    # Greedy random models fall into loops, which the n-gram proposer then predicts.
    free = [[(7 * i + j) % 500 + 100 for j in range(5)] * 4 for i in range(6)]
    greedy = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    pattern = r"[0-9]{3}-[a-z]{2}"
    proposed_for_constrained = []
    propose = spec.spec.propose

    def watching(running):
        propose(running)
        proposed_for_constrained.extend(s for s in running if s.params.constraint is not None and s.spec_token_ids)
    spec.spec.propose = watching
    params = [sampled(Constraint.json_schema(PERSON), seed=3), sampled(Constraint.regex(pattern), seed=4)]
    outs = spec.generate(["Describe a person:", "code:"] + free, params + [greedy] * len(free), use_tqdm=False)
    jsonschema.validate(json.loads(outs[0].text), PERSON)
    assert re.fullmatch(pattern, outs[1].text), outs[1].text
    assert not proposed_for_constrained
    assert spec.spec.stats.num_draft_tokens > 0  # the free rows did speculate
    want = plain.generate(free, greedy, use_tqdm=False)
    assert [o.token_ids for o in outs[2:]] == [w.token_ids for w in want]
    assert len(spec.guide) == 0
