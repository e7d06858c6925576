"""One request as the engine tracks it: its tokens, its blocks, its progress."""
from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chatloom.engine.block_hash import with_image_keys
from chatloom.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from chatloom.models.vision.prompt import ImageInput

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """(latency - TTFT) / (output tokens - 1), vLLM's definition."""
        if self.finished_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)

    def as_dict(self) -> dict:
        return {"queue_time": self.queue_time, "ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e,
                "prompt_tokens": self.num_prompt_tokens, "output_tokens": self.num_output_tokens,
                "cached_tokens": self.num_cached_tokens, "preemptions": self.num_preemptions}


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = 0, images: list[ImageInput] | None = None) -> None:
        self.request_id = request_id
        self.prompt_len = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.arrival_order = next(_arrival_counter)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        # Tokens whose K/V are already in the cache (computed or found in the prefix cache).
        self.num_computed_tokens = 0
        self.num_hashed_blocks = 0  # leading blocks already published in the prefix cache
        # Leading blocks given back because every layer's window has moved past them (their table
        # entries stay, unread: kv_cache_manager.release_behind_window).
        self.num_released_blocks = 0
        # Proposed next tokens the target checks in this step (speculative decoding); the
        # scheduler trims them to the step's budget and free blocks.
        self.spec_token_ids: list[int] = []
        self.finish_reason: str | None = None
        # A resume (params.resume_of) adopts or is counted against its round once, not again after a preemption.
        self.resume_counted = False
        self.metrics = RequestMetrics(arrival_time=time.time(), num_prompt_tokens=self.prompt_len)
        # Images whose embeddings replace the prompt's image tokens, and the prompt as the prefix
        # cache keys it (each image token standing for its image's hash).
        self.images: list[ImageInput] = list(images or [])
        self._keyed_prompt = with_image_keys(prompt_token_ids, [(i.content_hash, i.positions) for i in self.images]) \
            if self.images else None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            import torch  # only a seeded request needs it (the fleet simulator runs without torch)

            self.generator = torch.Generator().manual_seed(params.seed)
        # A request of n choices is n sequences: this one (index 0) and the forks made when its
        # prompt is computed (choices.py). Outputs carry the request's id and the choice's index.
        self.group_id = request_id
        self.index = 0
        self.forks: list[Sequence] = []  # made for this step's last prefill chunk, not yet holding blocks
        # Where asked: the prompt tokens' log probabilities found so far (None for the first token).
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None

    def fork(self, index: int) -> "Sequence":
        """Choice `index` of this request: the same tokens and timing, its own id and random stream
        (seed + index where a seed is given), no blocks yet."""
        child = Sequence(f"{self.group_id}#{index}", self.token_ids, self.params, self.priority, self.images)
        child.arrival_order = self.arrival_order
        child.group_id, child.index = self.group_id, index
        child.metrics = dataclasses.replace(self.metrics)
        child.prompt_logprobs = self.prompt_logprobs
        if self.params.seed is not None:
            import torch

            child.generator = torch.Generator().manual_seed(self.params.seed + index)
        return child

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def cache_token_ids(self) -> list[int]:
        """The tokens the prefix cache keys blocks by: token_ids, with image tokens keyed by image."""
        if self._keyed_prompt is None:
            return self.token_ids
        return self._keyed_prompt + self.token_ids[self.prompt_len:]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        """Lower priority number first, then first come, first served."""
        return (self.priority, self.arrival_order)

    def __repr__(self) -> str:
        return f"Sequence({self.request_id}, len={len(self)}, computed={self.num_computed_tokens})"
