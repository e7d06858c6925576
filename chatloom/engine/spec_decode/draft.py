"""The draft-model proposer: a smaller or cheaper model with the target's tokenizer
proposes k tokens autoregressively, with its own paged KV cache kept in step.

The draft keeps one shadow Sequence per request in its own KV-cache manager (so it has its
own prefix cache, keyed by its own id) and its own KV pool. Each proposal first catches
the shadow up on the tokens the target has appended since (one chunk: usually the last
kept proposal and the target's extra token), then decodes k - 1 more tokens. After the
target has judged them, `verified` cuts the shadow back to the tokens the two agree on:
the draft's K/V for rejected proposals is simply forgotten (its blocks trimmed), and only
blocks of agreed tokens are published in the draft's prefix cache. A preempted target
keeps its tokens, so its shadow stays valid; when the draft's pool is full, shadows of
sequences not proposing this step are dropped first.

Draft options for a model already loaded: `self-layers:N` (the target's first N layers,
its final norm and head: no extra weights), `self-int8` (the same GGUF weights through
the int8 matmul), or any registry id / path whose vocabulary matches.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from chatloom.engine.block_pool import BlockPool
from chatloom.engine.config import EngineConfig
from chatloom.engine.kv_cache_manager import KVCacheManager
from chatloom.engine.model_runner import ModelRunner
from chatloom.engine.scheduler import ScheduledBatch
from chatloom.engine.sampler import draw_token
from chatloom.engine.sequence import Sequence
from chatloom.engine.spec_decode.planner import CostModel
from chatloom.engine.spec_decode.proposer import Proposal
from chatloom.engine.spec_decode.rejection import target_probs
from chatloom.models.llama import LlamaForCausalLM
from chatloom.models.loader import LoadedModel, load_model
from chatloom.models.registry import REGISTRY


def first_layers(model: LlamaForCausalLM, n: int) -> LlamaForCausalLM:
    """A view of `model` that runs only its first n layers, then its norm and head
    (weights shared, nothing copied)."""
    if not 1 <= n <= model.config.num_layers:
        raise ValueError(f"self-layers:{n}: the model has {model.config.num_layers} layers")
    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    draft._modules["layers"] = nn.ModuleList(list(model.layers)[:n])
    draft.config = dataclasses.replace(model.config, num_layers=n)
    return draft


def resolve_draft(spec: str, target: LoadedModel) -> LoadedModel:
    """The draft model named by --speculative-model."""
    if spec.startswith("self-layers:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"speculative model {spec!r}: expected self-layers:N with N a number") from None
        model = first_layers(target.model, n)
        return LoadedModel(f"{target.id}:layers{n}", model, target.tokenizer, model.config)
    if spec == "self-int8":
        if target.id not in REGISTRY:
            raise ValueError("self-int8 needs a registry model as the target; give the GGUF path instead")
        spec_model = load_model(target.id, target.dtype, int8_matmul=True)
        spec_model.id = f"{target.id}:int8"
        return spec_model
    loaded = load_model(spec, target.dtype)
    if loaded.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"speculative model {spec!r} has {loaded.config.vocab_size} tokens in its vocabulary; "
                         f"the target has {target.config.vocab_size}: they must share a tokenizer")
    return loaded


class DraftModelProposer:
    costly = True

    def __init__(self, draft: LoadedModel, num_blocks: int, block_size: int, seed: int | None = None) -> None:
        self.draft = draft
        self.runner = ModelRunner(draft.model, num_blocks, block_size)
        self.kv = KVCacheManager(BlockPool(num_blocks, block_size, f"{draft.id}:draft"))
        self.shadows: dict[str, Sequence] = {}
        self._base: dict[str, int] = {}  # request id -> length of its tokens when proposals began
        self._generators: dict[str, torch.Generator] = {}
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()
        self.cost = CostModel()

    @classmethod
    def build(cls, config: EngineConfig, target: LoadedModel, num_blocks: int) -> "DraftModelProposer":
        if not config.speculative_model:
            raise ValueError("speculative mode 'draft' needs a speculative model (e.g. self-layers:8 or self-int8)")
        return cls(resolve_draft(config.speculative_model, target), num_blocks, config.block_size, config.seed)

    # -- keeping shadows -----------------------------------------------------------
    def _shadow(self, seq: Sequence, k: int, keep: set[str]) -> Sequence | None:
        """The draft's sequence for `seq`, synced and with blocks for k - 1 drafted tokens."""
        sh = self.shadows.get(seq.request_id)
        if sh is None:
            sh = Sequence(seq.request_id, list(seq.token_ids), seq.params)
            if not self._make_room(lambda: self.kv.can_allocate(sh), keep):
                return None
            self.kv.allocate(sh)
            self.shadows[seq.request_id] = sh
        else:
            self._sync(sh, seq)
        need = len(seq.token_ids) + k - 1
        if not self._make_room(lambda: self.kv.can_grow(sh, need), keep):
            return None
        self.kv.grow(sh, need)
        return sh

    def _make_room(self, fits, keep: set[str]) -> bool:
        while not fits():
            idle = next((rid for rid in self.shadows if rid not in keep), None)
            if idle is None:
                return False
            self._drop(idle)
        return True

    def _drop(self, request_id: str) -> None:
        sh = self.shadows.pop(request_id, None)
        if sh is not None:
            self.kv.free_sequence(sh)
        self._base.pop(request_id, None)
        self._generators.pop(request_id, None)

    # -- the Proposer interface ------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], max_lengths: list[int]) -> list[Proposal]:
        keep = {s.request_id for s in seqs}
        work: list[tuple[Sequence, Sequence, int]] = []
        for seq, k in zip(seqs, max_lengths):
            sh = self._shadow(seq, k, keep) if k > 0 else None
            if sh is not None:
                work.append((seq, sh, k))
                self._base[seq.request_id] = len(seq.token_ids)
        drafted: dict[str, list[int]] = {s.request_id: [] for s, _, _ in work}
        probs: dict[str, list[torch.Tensor]] = {s.request_id: [] for s, _, _ in work}
        for step in range(max((k for _, _, k in work), default=0)):
            active = [(seq, sh) for seq, sh, k in work if k > step]
            batch = ScheduledBatch()
            for _, sh in active:
                n = len(sh.token_ids) - sh.num_computed_tokens
                if n == 1:
                    batch.decodes.append(sh)
                else:
                    batch.prefills.append((sh, n))
            fwd = self.runner.execute(batch)
            logits, argmax, sampled = fwd.logits, fwd.argmax, fwd.sampled
            for row, sh in enumerate(sampled):
                seq = next(s for s, h in active if h is sh)
                if seq.params.greedy:
                    token = int(argmax[row]) if argmax is not None else int(logits[row].argmax())
                else:
                    q = target_probs(logits[row:row + 1], seq)[0]
                    token = draw_token(q, self._generator(seq))
                    probs[seq.request_id].append(q)
                sh.num_computed_tokens = len(sh.token_ids)
                sh.token_ids.append(token)
                drafted[seq.request_id].append(token)
        out = []
        for seq in seqs:
            tokens = drafted.get(seq.request_id, [])
            p = probs.get(seq.request_id)
            out.append(Proposal(tokens, torch.stack(p) if p else None))
        return out

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self.generator
        gen = self._generators.get(seq.request_id)
        if gen is None:  # the draft's own stream: the request's stream is the target's
            gen = self._generators[seq.request_id] = torch.Generator().manual_seed(seq.params.seed + 0x5eed)
        return gen

    def verified(self, seq: Sequence) -> None:
        sh = self.shadows.get(seq.request_id)
        if sh is not None:
            self._sync(sh, seq)

    def _sync(self, sh: Sequence, seq: Sequence) -> None:
        """Keep the draft's K/V only for tokens both sides agree on (the target may have
        kept some proposals, none, or never seen them when the step had no room)."""
        base = self._base.pop(seq.request_id, None)
        agree = min(len(sh.token_ids), len(seq.token_ids), base if base is not None else len(sh.token_ids))
        limit = min(len(sh.token_ids), len(seq.token_ids))
        while agree < limit and sh.token_ids[agree] == seq.token_ids[agree]:
            agree += 1
        # The last token is always recomputed: its logits give the next proposal.
        sh.num_computed_tokens = min(sh.num_computed_tokens, agree, len(seq.token_ids) - 1)
        sh.token_ids = list(seq.token_ids)
        self.kv.trim(sh, len(sh.token_ids))
        self.kv.register_full_blocks(sh)

    def forget(self, seq: Sequence) -> None:
        self._drop(seq.request_id)
