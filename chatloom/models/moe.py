"""Mixture-of-experts feed-forward layers (Mixtral, Qwen MoE), apart from the decoder they plug into."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from chatloom.models.config import ModelConfig


class SparseMoE(nn.Module):
    """Mixture-of-experts feed-forward (Mixtral, Qwen MoE): a router picks each token's
    top-k experts, and each expert runs once per step on just the tokens sent to it.

    Routing follows the model's own rule: softmax over all experts in float32, top-k, then
    (Mixtral, and Qwen when norm_topk_prob) the k weights renormalized to sum to one. A
    token's expert outputs are added in expert order, the same whatever else is in the batch."""

    def __init__(self, cfg: ModelConfig, expert: Callable[[int, int, str], nn.Module]) -> None:
        """`expert(hidden, intermediate, activation)` builds one expert's feed-forward (the dense MLP)."""
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.normalize = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(expert(cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act)
                                     for _ in range(cfg.num_experts))
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = expert(cfg.hidden_size, shared, cfg.hidden_act) if shared else None
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [T, k] and their weights [T, k]."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        slot_weights = weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                idx = tokens[start:start + n]
                y = self.experts[e](x[idx]) * slot_weights[start:start + n].unsqueeze(1)
                out.index_add_(0, idx, y)
                start += n
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
