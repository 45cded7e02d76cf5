"""Mixture-of-experts expert products on the CPU: grouped by expert, on the house's kernels.

Owns: `experts` (phaseflip::cpu_moe_experts: kernels/reference/moe.py's contract). Up to MOE_ROWS tokens
(decode steps) take moe.cpp's one-region call (library.moe_rows_op), where it built. Otherwise the
(token, slot) pairs are sorted by expert; each expert that any token chose multiplies its tokens' rows once (its
[gate; up] rows, SwiGLU, its down rows: kernels/cpu/linear.py's forms, the few-rows kernel at decode), and
each result row is added into its token's output scaled by its routing weight. Only the chosen experts'
weights are read, each once a step. One opaque op, so that a compiled step calls it as one extern (its
shapes inside depend on the routing).
"""
from __future__ import annotations

import torch

from phaseflip.kernels.cpu import library
from phaseflip.kernels.cpu import linear as cpu_linear
from phaseflip.kernels.op_registry import define_op
from phaseflip.kernels.reference.activation import silu_and_mul


def experts(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
    """h [T, H], gate_up [E, 2I, H], down [E, H, I], ids int64 / weights float32 [T, k] -> [T, H]."""
    return torch.ops.phaseflip.cpu_moe_experts(h, gate_up, down, ids, weights)


def _experts_body(h, gate_up, down, ids, weights):
    rows_op = library.moe_rows_op() if 1 <= h.shape[0] <= library.MOE_ROWS and h.dtype in library.DTYPES else None
    if rows_op is not None:
        return rows_op(h.contiguous(), gate_up, down, ids.contiguous(), weights.float().contiguous())
    return grouped(h, gate_up, down, ids, weights)


def grouped(h, gate_up, down, ids, weights):
    """The expert-by-expert path (any token count): each chosen expert's tokens through its products."""
    k = ids.shape[1]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)            # (token, slot) pairs, expert by expert
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    tokens = order // k
    scale = weights.flatten()[order]
    out = torch.zeros(h.shape, dtype=torch.float32)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        y = cpu_linear.linear(silu_and_mul(cpu_linear.linear(h[rows], gate_up[e])), down[e])   # [n, H]
        out.index_add_(0, rows, y.float() * scale[start:start + n, None])
        start += n
    return out.to(h.dtype)


define_op("cpu_moe_experts(Tensor h, Tensor gate_up, Tensor down, Tensor ids, Tensor weights) -> Tensor",
          _experts_body, lambda h, gate_up, down, ids, weights: torch.empty_like(h))
