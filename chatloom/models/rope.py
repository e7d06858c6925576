"""Rotary position tables for every RoPE scaling a checkpoint can ask for.

Each scaling (none, linear, dynamic NTK, llama3, YaRN) comes down to a cos/sin table with
one row per position, so the decoder, the C++ rotary kernel and the paged KV cache need not
know which one a model uses. The formulas follow the papers and transformers' reading of
them, computed in float64 and rounded once.

Dynamic NTK changes the base with the sequence length. transformers recomputes it for the
longest position of each forward call, so a cached key keeps the rotation it was given when
it was computed; here a token at position p is rotated as if the sequence ended there
(length p + 1), which is what transformers gives when it decodes token by token, and which
does not depend on how a prompt was chunked or batched.
"""
from __future__ import annotations

import math

import torch

from chatloom.models.config import ModelError, RopeScaling


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(dim: int, theta: float, scaling: RopeScaling, trained_max_position: int
                        ) -> tuple[torch.Tensor, float]:
    """Position-independent inverse frequencies [dim/2] (float64) and the factor that
    multiplies cos and sin. `trained_max_position` is the config's max_position_embeddings."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    kind, factor = scaling.type, scaling.factor
    if kind in ("default", "dynamic"):
        return inv, 1.0
    if kind == "linear":
        return inv / factor, 1.0
    original = scaling.original_max_position or trained_max_position
    if kind == "llama3":
        if scaling.freq_factors is not None:  # GGUF: the converter's divisors, per frequency
            factors = torch.tensor(scaling.freq_factors, dtype=torch.float64)
            if factors.numel() != inv.numel():
                raise ModelError(f"rope_freqs has {factors.numel()} values, expected {inv.numel()}")
            return inv / factors, 1.0
        low_wavelen = original / scaling.low_freq_factor
        high_wavelen = original / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn: interpolate the low frequencies, keep the high ones, ramp in between.
    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the frequency as trained), 0: interpolate
    inv = inv / factor * (1 - keep) + inv * keep
    attention = scaling.attention_factor
    if attention is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention = _yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)
    return inv, float(attention)


def rope_tables(dim: int, theta: float, scaling: RopeScaling, trained_max_position: int,
                positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, dim/2], float32, already multiplied by the attention factor."""
    t = torch.arange(positions, dtype=torch.float64)
    if scaling.type == "dynamic":
        # Each position's base as if the sequence ended there (see the module docstring).
        length = torch.clamp(t + 1, min=trained_max_position)
        base = theta * ((scaling.factor * length / trained_max_position) - (scaling.factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
        freqs = t.unsqueeze(1) / base.unsqueeze(1) ** exponents.unsqueeze(0)
        attention = 1.0
    else:
        inv, attention = inverse_frequencies(dim, theta, scaling, trained_max_position)
        freqs = torch.outer(t, inv)
    return (freqs.cos() * attention).float(), (freqs.sin() * attention).float()
