"""Constrained answers that run short of tokens: steered to close their structure in time, or cut
with finish_reason "length". The random model wanders anywhere its grammar allows, so whatever
closing happens here is the steering's doing; the real SmolLM2 checks the same on a real model."""
from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest
import torch

from chatloom.app.generation.tool_calls import ToolCallParser, ToolSpec, ToolUse
from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.engine.structured.closing import StringState, closing_walk
from chatloom.engine.structured.constraint import Constraint
from chatloom.models.gguf_loader import open_gguf
from chatloom.models.loader import LoadedModel
from chatloom.models.registry import smollm2_path, tiny_random_config
from chatloom.models.tokenizer import from_gguf
from chatloom.models.weights import random_model

WEATHER = ToolSpec("get_weather", "The weather in a city now.", {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False})
ADD = ToolSpec("add", "Add two small numbers.", {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False})
TOOLS = ToolUse((WEATHER, ADD), "required")
SCHEMAS = {t.name: t.parameters for t in TOOLS.tools}
BUDGETS = list(range(40, 121, 10))


@pytest.fixture(scope="module")
def tiny_smol() -> LoadedModel:
    tok = from_gguf(open_gguf(smollm2_path()))
    cfg = tiny_random_config()
    cfg.vocab_size = tok.vocab_size
    return LoadedModel("tiny-smol", random_model(cfg, torch.float32), tok, cfg)


@pytest.fixture(scope="module")
def engine(tiny_smol) -> LLMEngine:
    return LLMEngine(tiny_smol, EngineConfig(num_blocks=1024, max_num_seqs=32, seed=0))


def calls_in(text: str) -> list | None:
    """The answer's tool calls when the whole answer is well-formed calls, else None."""
    parser = ToolCallParser(TOOLS.names())
    parts = parser.push(text) + parser.finish()
    if not parser.calls or any(isinstance(p, str) and p.strip() for p in parts):
        return None
    for call in parser.calls:
        jsonschema.validate(call.parsed_arguments, SCHEMAS[call.name])
    return parser.calls


def test_forced_tool_calls_close_within_every_budget(engine):
    params = [SamplingParams(max_tokens=n, temperature=1.0, seed=n, constraint=TOOLS.constraint()) for n in BUDGETS]
    outs = engine.generate(["Call a tool."] * len(params), params, use_tqdm=False)
    for n, out in zip(BUDGETS, outs):
        assert calls_in(out.text), (n, out.text)
        # Complete calls; "length" only where the last call closed on the budget's last token (no room for EOS).
        assert out.finish_reason == "stop" or out.num_output_tokens == n, (n, out.text)


def test_json_object_closes_within_every_budget(engine):
    params = [SamplingParams(max_tokens=n, temperature=1.0, seed=n, constraint=Constraint.json_object())
              for n in BUDGETS]
    outs = engine.generate(["{"] * len(params), params, use_tqdm=False)
    for n, out in zip(BUDGETS, outs):
        assert isinstance(json.loads(out.text), dict), (n, out.text)
        assert out.finish_reason == "stop" or out.num_output_tokens == n, (n, out.text)


def test_a_budget_too_small_for_any_answer_ends_as_length(engine):
    # The shortest call block is about 40 tokens: 20 cannot hold one.
    out = engine.generate(["Call a tool."], [SamplingParams(max_tokens=20, temperature=1.0, seed=1,
                                                           constraint=TOOLS.constraint())], use_tqdm=False)[0]
    assert out.finish_reason == "length" and out.num_output_tokens == 20
    assert calls_in(out.text) is None


def test_the_context_window_is_a_budget_too(tiny_smol):
    engine = LLMEngine(tiny_smol, EngineConfig(num_blocks=256, max_num_seqs=4, max_model_len=64, seed=0))
    prompt = list(range(100, 110))  # 54 tokens of room, well under max_tokens
    out = engine.generate([prompt], [SamplingParams(max_tokens=500, temperature=1.0, seed=3,
                                                   constraint=TOOLS.constraint())], use_tqdm=False)[0]
    assert out.finish_reason == "stop" and calls_in(out.text), out.text


def test_closing_walk_from_a_wandering_state_is_valid_json(engine):
    # Drive a matcher into the middle of a string inside nested containers, then walk it closed.
    guide = engine.guide
    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "string"}, "minItems": 2},
                                               "n": {"type": "integer"}}, "required": ["xs", "n"]}
    matcher = llguidance.LLMatcher(guide.ll_tokenizer, Constraint.json_schema(schema).grammar, log_level=0)
    strings = StringState()
    prefix = guide.ll_tokenizer.tokenize_str('{"xs": ["ab')
    assert matcher.consume_tokens(prefix)
    for t in prefix:
        strings.feed(guide.closing_table.token_bytes[t])
    assert strings.inside
    walk = closing_walk(matcher, strings, guide.closing_table, limit=64)
    assert walk is not None and walk[-1] in engine.eos_ids
    text = guide.ll_tokenizer.decode_str(prefix + walk[:-1])
    jsonschema.validate(json.loads(text), schema)
    assert closing_walk(matcher, strings, guide.closing_table, limit=3) is None  # too few tokens for it


def test_requests_without_a_grammar_or_without_eos_are_not_steered(engine):
    engine.add_request("x", SamplingParams(max_tokens=5), request_id="free")
    engine.add_request("y", SamplingParams(max_tokens=5, ignore_eos=True, constraint=Constraint.json_object()),
                       request_id="no-eos")
    assert not engine.guide._budgets
    engine.abort("free")
    engine.abort("no-eos")


@pytest.mark.slow
def test_real_model_tool_calls_and_json_close_within_every_budget(smollm2):
    from chatloom.models.chat_template import encode_chat

    engine = LLMEngine(smollm2, EngineConfig(num_blocks=512, max_num_seqs=16))
    system = TOOLS.system_text()
    ask = encode_chat(smollm2.tokenizer, [{"role": "system", "content": system},
                                          {"role": "user", "content": "What is the weather in Paris, and what is 2+3?"}])
    budgets = [40, 60, 80, 100, 120]
    params = [SamplingParams(max_tokens=n, temperature=0, constraint=TOOLS.constraint()) for n in budgets]
    outs = engine.generate([ask] * len(budgets), params, use_tqdm=False)
    for n, out in zip(budgets, outs):
        assert calls_in(out.text), (n, out.text)
        assert out.finish_reason == "stop" or out.num_output_tokens == n, (n, out.text)
    ask = encode_chat(smollm2.tokenizer, [{"role": "user", "content": "Describe three cities in detail, as JSON."}])
    params = [SamplingParams(max_tokens=n, temperature=0, constraint=Constraint.json_object()) for n in budgets]
    outs = engine.generate([ask] * len(budgets), params, use_tqdm=False)
    for n, out in zip(budgets, outs):
        assert isinstance(json.loads(out.text), dict), (n, out.text)
        assert out.finish_reason == "stop" or out.num_output_tokens == n, (n, out.text)
