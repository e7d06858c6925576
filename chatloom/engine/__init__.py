"""One engine replica: sequences, KV-cache manager over a block pool, scheduler, model runner, sampler,
output processor, speculative decoding, structured output, the engine loops (sync and async).
Knows nothing of HTTP, users or databases."""
import importlib

# Loaded on first use (PEP 562): a module of the engine, such as the scheduler the fleet simulator
# runs, can be imported without the model runner and torch behind LLMEngine.
_EXPORTS = {"EngineConfig": "chatloom.engine.config", "LLMEngine": "chatloom.engine.llm_engine",
            "RequestOutput": "chatloom.engine.outputs", "InvalidRequest": "chatloom.engine.sampling_params",
            "SamplingParams": "chatloom.engine.sampling_params"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(_EXPORTS[name]), name)
    return value
