"""Rotary position embedding: the cos/sin table (default and llama3 scaling) and its application.

The table is computed once per model in float32 (as HF does) and indexed by position at run time.
Neox/HF layout: the head dimension is split in two halves (rotate_half), not interleaved.
"""
from __future__ import annotations

import math

import torch


def inv_frequencies(head_dim: int, theta: float, scaling=None) -> torch.Tensor:
    """[head_dim // 2] float32; `scaling` is a RopeScaling (llama3) or None."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
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


def cos_sin_table(head_dim: int, max_positions: int, theta: float, scaling=None) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second."""
    inv_freq = inv_frequencies(head_dim, theta, scaling)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos_sin: [T, D] (already gathered by position)
    half = x.shape[-1] // 2
    cos = cos_sin[:, None, :half].to(x.dtype)
    sin = cos_sin[:, None, half:].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
