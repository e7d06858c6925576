"""One engine replica: sequences, KV-cache manager over a block pool, scheduler, model runner, sampler,
output processor, speculative decoding, structured output, the engine loops (sync and async).
Knows nothing of HTTP, users or databases."""
from chatloom.engine.config import EngineConfig
from chatloom.engine.llm_engine import LLMEngine
from chatloom.engine.outputs import RequestOutput
from chatloom.engine.sampling_params import InvalidRequest, SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "InvalidRequest", "SamplingParams"]
