"""One engine replica: sequences, KV-cache manager over a block pool, scheduler, model runner, sampler,
output processor, speculative decoding, structured output, the engine loops (sync and async).
Knows nothing of HTTP, users or databases."""
from chatloom.lazy_exports import lazy_getattr

# Loaded on first use (PEP 562): a module of the engine, such as the scheduler the fleet simulator
# runs, can be imported without the model runner and torch behind LLMEngine.
_EXPORTS = {"EngineConfig": "chatloom.engine.config", "LLMEngine": "chatloom.engine.llm_engine",
            "RequestOutput": "chatloom.engine.outputs", "InvalidRequest": "chatloom.engine.sampling_params",
            "SamplingParams": "chatloom.engine.sampling_params"}

__all__ = list(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
