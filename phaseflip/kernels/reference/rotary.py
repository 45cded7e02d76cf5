"""Rotary position embedding: the cos/sin table (default, llama3, linear and yarn scaling) and its application.

The table is computed once per model in float32 (as HF does) and indexed by position at run time.
Neox/HF layout: the head dimension is split in two halves (rotate_half), not interleaved.
"""
from __future__ import annotations

import math

import torch


def inv_frequencies(head_dim: int, theta: float, scaling=None) -> torch.Tensor:
    """[head_dim // 2] float32; `scaling` is one of rank/model_config.py's scalings (its rope_type: llama3,
    linear, yarn, factors) or None."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = getattr(scaling, "rope_type", "llama3")
    if scaling is None:
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling.factor
    if kind == "factors":
        return inv_freq / torch.tensor(scaling.factors, dtype=torch.float32)
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn(dim: int, theta: float, s) -> torch.Tensor:
    """YaRN: each dimension's frequency kept (extrapolated) where it rotates more than beta_fast times over
    the original context, divided by factor (interpolated) where less than beta_slow, a linear ramp between."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high + 0.001 if low == high else high) - low))
    keep = 1 - ramp.clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)   # as transformers rounds them
    return 1.0 / (s.factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def cos_sin_table(head_dim: int, max_positions: int, theta: float, scaling=None) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second."""
    inv_freq = inv_frequencies(head_dim, theta, scaling)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    factor = getattr(scaling, "attention_factor", 1.0)   # YaRN scales cos and sin alike
    return table if factor == 1.0 else table * factor


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos_sin: [T, D] (already gathered by position)
    half = x.shape[-1] // 2
    cos = cos_sin[:, None, :half].to(x.dtype)
    sin = cos_sin[:, None, half:].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
