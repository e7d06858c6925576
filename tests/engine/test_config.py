"""The engine's configuration is the only source of the scheduler's limits."""
from __future__ import annotations

import dataclasses

import pytest

from chatloom.engine import EngineConfig, LLMEngine
from chatloom.engine.config import CPU_BACKGROUND_STEP_TOKENS, DEFAULT_MAX_MODEL_LEN, SchedulerConfig


def test_the_scheduler_config_has_no_defaults_of_its_own():
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               for f in dataclasses.fields(SchedulerConfig))
    with pytest.raises(TypeError):
        SchedulerConfig()  # type: ignore[call-arg]


def test_the_scheduler_config_is_read_from_the_engine_config():
    config = EngineConfig(max_num_batched_tokens=33, max_num_seqs=7, enable_chunked_prefill=False,
                          background_priority=50)
    assert SchedulerConfig.from_engine(config, 100) == SchedulerConfig(
        max_num_batched_tokens=33, max_num_seqs=7, max_model_len=100, enable_chunked_prefill=False,
        background_priority=50, background_yield="step", background_step_tokens=CPU_BACKGROUND_STEP_TOKENS)
    on_a_gpu = SchedulerConfig.from_engine(config, 100, "cuda")
    assert (on_a_gpu.background_yield, on_a_gpu.background_step_tokens) == ("prefill", None)
    assert SchedulerConfig.from_engine(EngineConfig(background_step_tokens=8), 100, "cuda").background_step_tokens == 8
    # Every limit the scheduler has is a field of the engine's configuration, under the same name.
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert {f.name for f in dataclasses.fields(SchedulerConfig)} <= engine_fields


def test_the_context_window_is_the_models_capped_unless_set():
    assert EngineConfig().resolve_max_model_len(2048) == 2048
    assert EngineConfig().resolve_max_model_len(131072) == DEFAULT_MAX_MODEL_LEN
    assert EngineConfig(max_model_len=300).resolve_max_model_len(131072) == 300


def test_the_engine_schedules_with_its_own_configuration(tiny_model):
    config = EngineConfig(num_blocks=64, max_num_batched_tokens=40, max_num_seqs=5, max_model_len=120,
                          enable_chunked_prefill=False)
    engine = LLMEngine(tiny_model, config)
    assert engine.scheduler.config == SchedulerConfig.from_engine(config, 120)
    assert engine.max_model_len == engine.output_processor.max_model_len == 120
    default = LLMEngine(tiny_model, EngineConfig(num_blocks=64))
    assert default.scheduler.config.max_model_len == default.max_model_len == \
        min(tiny_model.config.max_position, DEFAULT_MAX_MODEL_LEN)


# -- the KV pool's size ---------------------------------------------------------------------------------

from chatloom.engine.kv_sizing import AUTO_KV_CONTEXTS, AUTO_KV_MEMORY_SHARE, plan_kv_pool  # noqa: E402

GIB = 1024**3


def test_an_unset_pool_holds_a_few_full_contexts_when_memory_allows():
    # The 1.7B shape in float32: 384 KiB a token, 3 GiB for one 8,192-token context.
    per_token = 2 * 24 * 32 * 64 * 4
    plan = EngineConfig().plan_kv_pool(per_token, 8192, available=64 * GIB)
    assert plan.how == "auto" and plan.tokens == AUTO_KV_CONTEXTS * 8192
    assert plan.bytes == AUTO_KV_CONTEXTS * 3 * GIB and plan.full_contexts == AUTO_KV_CONTEXTS


def test_an_unset_pool_takes_at_most_its_share_of_the_memory_available():
    per_token = 2 * 24 * 32 * 64 * 4
    plan = EngineConfig().plan_kv_pool(per_token, 8192, available=16 * GIB, reserved=2 * GIB)
    assert plan.available_bytes == 14 * GIB and plan.cap_bytes == int(14 * GIB * AUTO_KV_MEMORY_SHARE)
    assert plan.bytes <= plan.cap_bytes < plan.bytes + 16 * per_token  # whole blocks
    assert plan.context_tokens == 8192 < plan.tokens  # still more than one full context
    starved = EngineConfig().plan_kv_pool(per_token, 8192, available=GIB)
    assert starved.tokens == GIB // 2 // per_token // 16 * 16 < 8192  # the window is then the pool's


def test_a_set_pool_size_wins_and_unknown_memory_gives_one_context():
    assert EngineConfig(num_blocks=7, kv_cache_gb=3.0).plan_kv_pool(1024, 4096, available=GIB).blocks == 7
    assert EngineConfig(kv_cache_gb=1.0).plan_kv_pool(1024, 4096, available=1).tokens == GIB // 1024
    assert plan_kv_pool(1024, 16, 4096).how == "auto-unknown-memory"
    assert plan_kv_pool(1024, 16, 4096).tokens == 4096


def test_a_window_on_every_layer_bounds_what_a_context_needs():
    plan = plan_kv_pool(1024, 16, 8192, available=64 * GIB, window=1000)
    assert plan.tokens_per_context == (63 + 2) * 16 and plan.tokens == AUTO_KV_CONTEXTS * plan.tokens_per_context


def test_the_engine_sizes_its_pool_from_the_memory_available(tiny_model, monkeypatch):
    from chatloom.engine import config as config_module

    monkeypatch.setattr(config_module, "available_memory_bytes", lambda: 10**12)
    engine = LLMEngine(tiny_model, EngineConfig())
    context = engine.max_model_len
    assert engine.kv_pool_plan.how == "auto"
    assert engine.pool_tokens == AUTO_KV_CONTEXTS * context
    monkeypatch.setattr(config_module, "available_memory_bytes", lambda: 100 * 1024)
    small = LLMEngine(tiny_model, EngineConfig())
    assert small.pool_tokens * small.kv_pool_plan.bytes_per_token <= 50 * 1024
