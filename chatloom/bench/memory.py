"""How much of the reserved KV memory holds real tokens: paged blocks against a
contiguous max-length reservation per request (what a naive server allocates)."""
from __future__ import annotations

from chatloom.bench.throughput import pool_blocks_for
from chatloom.bench.workload import BenchRequest
from chatloom.engine import EngineConfig, LLMEngine, SamplingParams
from chatloom.models.loader import LoadedModel


def run_memory(loaded: LoadedModel, requests: list[BenchRequest], max_num_seqs: int = 64,
               block_size: int = 16, reserve_len: int | None = None) -> dict:
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=max_num_seqs, block_size=block_size,
                                            enable_prefix_caching=False,
                                            num_blocks=pool_blocks_for(requests, block_size)))
    reserve = reserve_len or engine.max_model_len
    for r in requests:
        engine.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True))
    used = paged = contiguous = per_request = 0
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        if not running:
            continue
        steps += 1
        # Sampled after each step: the sequences' real tokens (in the cache or being written
        # by the current prefill) vs what each scheme reserves.
        used += sum(min(len(s), len(s.block_table) * block_size) for s in running)
        paged += sum(len(s.block_table) for s in running) * block_size
        contiguous += len(running) * reserve
        per_request += sum(s.prompt_len + s.params.max_tokens for s in running)
    return {
        "benchmark": "memory", "requests": len(requests), "steps_sampled": steps, "block_size": block_size,
        "paged_utilization": round(used / paged, 4),
        "contiguous_max_len_utilization": round(used / contiguous, 4),
        "contiguous_reservation_len": reserve,
        "contiguous_prompt_plus_max_tokens_utilization": round(used / per_request, 4),
    }
