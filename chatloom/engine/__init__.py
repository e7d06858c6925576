"""One engine replica: sequences, block manager, scheduler, model runner, sampler, engine loops.
Knows nothing of HTTP, users or databases."""
from chatloom.engine.config import EngineConfig
from chatloom.engine.llm_engine import LLMEngine
from chatloom.engine.outputs import RequestOutput
from chatloom.engine.sampling_params import InvalidRequest, SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "InvalidRequest", "SamplingParams"]
