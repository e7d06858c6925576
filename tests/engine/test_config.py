"""The engine's configuration is the only source of the scheduler's limits."""
from __future__ import annotations

import dataclasses

import pytest

from chatloom.engine import EngineConfig, LLMEngine
from chatloom.engine.config import DEFAULT_MAX_MODEL_LEN, SchedulerConfig


def test_the_scheduler_config_has_no_defaults_of_its_own():
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               for f in dataclasses.fields(SchedulerConfig))
    with pytest.raises(TypeError):
        SchedulerConfig()  # type: ignore[call-arg]


def test_the_scheduler_config_is_read_from_the_engine_config():
    config = EngineConfig(max_num_batched_tokens=33, max_num_seqs=7, enable_chunked_prefill=False)
    assert SchedulerConfig.from_engine(config, 100) == SchedulerConfig(
        max_num_batched_tokens=33, max_num_seqs=7, max_model_len=100, enable_chunked_prefill=False)
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
