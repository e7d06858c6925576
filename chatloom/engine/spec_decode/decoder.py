"""The engine's one handle on speculative decoding: propose before scheduling, verify
after the forward pass, count what happened.

Each step: sequences about to decode get proposals (trimmed by the planner, then by the
scheduler to the budget and free blocks left after every decode and prefill); the
target scores [last token, proposals...] of each in the same forward as everything else;
verify() keeps the longest acceptable run plus one token from the target. The engine
then rolls back the KV blocks of what was not kept.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from chatloom.engine.config import EngineConfig
from chatloom.engine.sampler import GreedyPicks, Sampler, SamplingError
from chatloom.engine.sequence import Sequence
from chatloom.engine.spec_decode.planner import AcceptanceTracker, CostModel, plan_lengths
from chatloom.engine.spec_decode.proposer import NgramProposer, Proposal, Proposer
from chatloom.engine.spec_decode.rejection import Rule, exact_rule
from chatloom.engine.spec_decode.verify import verify_proposals

MODES = ("off", "ngram", "draft")


@dataclass
class SpecDecodeStats:
    """Counters named after vLLM's spec_decode metrics, so figures compare."""

    num_drafts: int = 0  # sequence-steps that carried at least one proposed token
    num_draft_tokens: int = 0  # proposed tokens the target checked
    num_accepted_tokens: int = 0  # proposed tokens kept
    num_emitted_tokens: int = 0  # tokens those sequence-steps produced (kept + one from the target)
    num_spec_steps: int = 0  # engine steps with any proposed token
    num_plain_steps: int = 0  # decode steps where the planner chose not to speculate

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_emitted_tokens": self.num_emitted_tokens,
                "spec_decode_acceptance_rate": round(self.acceptance_rate, 4),
                "spec_decode_spec_steps": self.num_spec_steps,
                "spec_decode_plain_steps": self.num_plain_steps}


class SpeculativeDecoder:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, max_model_len: int,
                 adaptive: bool = True, draft_cost: CostModel | None = None) -> None:
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        self.proposer = proposer
        self.k_max = num_speculative_tokens
        self.max_model_len = max_model_len
        self.adaptive = adaptive
        self.cost = CostModel()
        self.draft_cost = draft_cost
        self.acceptance = AcceptanceTracker()
        self.stats = SpecDecodeStats()
        self.rule: Rule = exact_rule
        self._draft_probs: dict[str, torch.Tensor] = {}
        self._sources: dict[str, int] = {}  # request id -> Proposal.source of this step's proposal

    # -- before scheduling ----------------------------------------------------------
    def _cap(self, seq: Sequence) -> int:
        """Proposals past the request's last token or the context window would be wasted."""
        p = seq.params
        return max(0, min(self.k_max, p.max_tokens - seq.num_output_tokens - 1, self.max_model_len - len(seq)))

    def propose(self, running: list[Sequence]) -> None:
        """Set spec_token_ids on every running sequence whose next step is a decode."""
        self._draft_probs.clear()
        self._sources.clear()
        # Constrained requests never speculate: their grammar masks only the next token's row; nor do
        # requests for logprobs, which are read from one row per sequence.
        ready = [s for s in running if len(s) - s.num_computed_tokens == 1 and s.params.constraint is None
                 and s.params.logprobs is None]
        for seq in running:
            seq.spec_token_ids = []
        if not ready:
            return
        caps = [self._cap(s) for s in ready]
        if self.proposer.costly:
            # Lengths are planned before proposing, so there is no proposal source to go by yet.
            rates = [self.acceptance.rate(s.request_id) for s in ready]
            ks = plan_lengths(rates, caps, self.cost, self.draft_cost) if self.adaptive else caps
            chosen = [i for i, k in enumerate(ks) if k > 0]
            proposals = self.proposer.propose([ready[i] for i in chosen], [ks[i] for i in chosen])
            pairs = [(ready[i], prop) for i, prop in zip(chosen, proposals)]
        else:
            proposals = self.proposer.propose(ready, caps)
            if self.adaptive:
                rates = [self.acceptance.rate(s.request_id, p.source) for s, p in zip(ready, proposals)]
                ks = plan_lengths(rates, [len(p.tokens) for p in proposals], self.cost)
            else:
                ks = [len(p.tokens) for p in proposals]
            pairs = [(seq, Proposal(prop.tokens[:k], None if prop.probs is None else prop.probs[:k], prop.source))
                     for seq, prop, k in zip(ready, proposals, ks) if k > 0]
        for seq, prop in pairs:
            seq.spec_token_ids = list(prop.tokens)
            self._sources[seq.request_id] = prop.source
            if prop.probs is not None:
                self._draft_probs[seq.request_id] = prop.probs
        if not pairs:
            self.stats.num_plain_steps += 1

    # -- after the forward pass -------------------------------------------------------
    def verify(self, logits: torch.Tensor, argmax: torch.Tensor | None, sampled: list[Sequence],
               sampler: Sampler, eos_ids: list[int], picks: GreedyPicks | None = None
               ) -> tuple[list[list[int]], dict[int, SamplingError]]:
        """New tokens for each sequence in `sampled` and the failures by index (verify.py), counted."""
        out, failures = verify_proposals(logits, argmax, sampled, sampler, eos_ids, picks, self._draft_probs,
                                         self.rule)
        any_spec = False
        for i, seq in enumerate(sampled):
            if seq.spec_token_ids:
                any_spec = True
                if i not in failures:
                    self._count(seq, seq.spec_token_ids, out[i])
        if any_spec:
            self.stats.num_spec_steps += 1
        return out, failures

    def _count(self, seq: Sequence, proposed: list[int], tokens: list[int]) -> None:
        """Acceptance and counters for one checked run: `tokens` are the kept proposals plus one."""
        kept = len(tokens) - 1
        self.acceptance.record(seq.request_id, len(proposed), kept, self._sources.get(seq.request_id, 0))
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += len(proposed)
        st.num_accepted_tokens += kept

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode-only forward over num_tokens tokens took this long."""
        self.cost.observe(num_tokens, seconds)

    def verified(self, seq: Sequence, emitted: int) -> None:
        """The engine appended `emitted` of the checked run's tokens to `seq` (fewer than
        verify returned when a stop fell inside the run)."""
        self.stats.num_emitted_tokens += emitted
        if not seq.is_finished:
            self.proposer.verified(seq)

    def forget(self, seq: Sequence) -> None:
        self.acceptance.forget(seq.request_id)
        self.proposer.forget(seq)


def build_speculative_decoder(config: EngineConfig, max_model_len: int, target_loaded=None,
                              num_blocks: int = 0) -> SpeculativeDecoder | None:
    """The decoder for config.speculative, or None when it is off."""
    mode = config.speculative
    if mode not in MODES:
        raise ValueError(f"unknown speculative mode {mode!r} (use {', '.join(MODES)})")
    if mode == "off":
        return None
    if mode == "ngram":
        proposer: Proposer = NgramProposer()
        return SpeculativeDecoder(proposer, config.num_speculative_tokens, max_model_len,
                                  config.speculative_adaptive)
    from chatloom.engine.spec_decode.draft import DraftModelProposer
    proposer = DraftModelProposer.build(config, target_loaded, num_blocks)
    return SpeculativeDecoder(proposer, config.num_speculative_tokens, max_model_len,
                              config.speculative_adaptive, draft_cost=proposer.cost)
