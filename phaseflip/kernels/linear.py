"""Dense projections (x @ W^T) for the model maths: the weight-stationary form for a few rows on the CPU.

Owns: `linear`. For a handful of rows (decode), the product F.linear runs (x @ W^T) streams the weight
at about half the memory bandwidth on the project's CPUs, while the same product written W @ x^T takes
MKL's skinny GEMM path and streams it near the bandwidth. Measured on 2 cores (torch 2.13, every
projection of a SmolLM2-135M step, weights out of cache): 1 row 33.7 -> 16.2 ms, 2 rows 59.0 -> 16.6,
3 rows 73.2 -> 17.9, 8 rows 47.8 -> 33.9; from 24 rows F.linear is as fast or faster, so it keeps those.
One row is run as two (a copy of it): the one-column product dispatches to GEMV, the slow path again.
CUDA tensors always take F.linear (cuBLAS has no such cliff).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SMALL_BATCH = 16   # rows up to which the weight-stationary form is used on the CPU


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [M, K], weight: [N, K] -> [M, N]
    m = x.shape[0]
    if x.is_cuda or x.dim() != 2 or not 1 <= m <= SMALL_BATCH:
        return F.linear(x, weight, bias)
    cols = x.repeat(2, 1) if m == 1 else x                   # [M', K]
    out = torch.mm(weight, cols.t())[:, :m].t().contiguous()   # [M, N]
    return out if bias is None else out.add_(bias)
