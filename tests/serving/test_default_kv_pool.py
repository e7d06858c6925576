"""With the default settings a served model gets its full context window, and the pool the memory
check counts is the one the engine allocates."""
from __future__ import annotations

import asyncio

from chatloom.engine import EngineConfig
from chatloom.engine import config as engine_config
from chatloom.engine.kv_sizing import AUTO_KV_CONTEXTS
from chatloom.serving.local import LocalBackend


def test_the_default_pool_gives_the_full_context_window(tiny_model_fp32, monkeypatch):
    monkeypatch.setattr(engine_config, "available_memory_bytes", lambda: 8 * 2**30)
    backend = LocalBackend(tiny_model_fp32, engine_config=EngineConfig())
    planned = backend.kv_cache_bytes(tiny_model_fp32.config)
    asyncio.run(backend.start())
    try:
        engine = backend.engine.engine
        assert backend.context_window == engine.max_model_len == tiny_model_fp32.config.max_position
        assert engine.pool_tokens == AUTO_KV_CONTEXTS * engine.max_model_len
        assert planned == engine.kv_pool_plan.bytes
    finally:
        asyncio.run(backend.close())


def test_the_memory_check_counts_a_16_bit_pool_in_the_int8_mode(tiny_model_fp32, monkeypatch):
    monkeypatch.setattr(engine_config, "available_memory_bytes", lambda: 8 * 2**30)
    cfg = tiny_model_fp32.config
    exact = LocalBackend("tiny-random", engine_config=EngineConfig(kv_cache_gb=1.0)).kv_cache_bytes(cfg)
    int8 = LocalBackend("tiny-random", engine_config=EngineConfig(kv_cache_gb=1.0), int8_matmul=True)
    assert exact == int8.kv_cache_bytes(cfg) == 2**30  # a GiB either way, in whole blocks
    auto = LocalBackend("tiny-random", engine_config=EngineConfig())
    auto_int8 = LocalBackend("tiny-random", engine_config=EngineConfig(), int8_matmul=True)
    assert auto.kv_cache_bytes(cfg) == 2 * auto_int8.kv_cache_bytes(cfg)  # same tokens, half the bytes
