"""Mixture-of-experts expert products as Triton kernels (CUDA).

Owns: `moe_experts_triton` (kernels/reference/moe.py's contract) and `sort_pairs`. The (token, slot) pairs
are sorted by expert with torch ops, each expert's run padded to whole tiles of BLOCK_M; one grouped product
kernel then gives each program one tile (one expert, up to BLOCK_M of its pairs) against a tile of that
expert's weight rows, tl.dot over K (ieee float32 for float32, tf32 for bfloat16: exact products of bf16
values, float32 sums). It runs
twice: the pairs' tokens against [gate; up] rows, SwiGLU between, their activations against down rows; the
routing weights then sum each token's k rows. Only the chosen experts' weights are read. Launch sizes depend
on shapes alone (at most T*k + E*(BLOCK_M - 1) padded slots; tiles past the last expert's do nothing) and
nothing waits on the host, so a CUDA graph captures it. Never launched at import.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from phaseflip.kernels.reference.activation import silu_and_mul

BLOCK_N, BLOCK_K = 64, 32


def sort_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (the pair (t * k + slot) at each padded slot, T*k where padding: [P]; the expert of each
    tile of block_m slots, num_experts past the last: [P // block_m]), with P a shape-only bound."""
    flat = ids.flatten()
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)             # pairs expert by expert, in token order within one
    expert = flat[order]
    rank = torch.arange(n, device=ids.device) - (torch.cumsum(counts, 0) - counts)[expert]
    slots = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    pair_at = torch.full((slots,), n, dtype=torch.int64, device=ids.device)
    pair_at.scatter_(0, (ends - padded)[expert] + rank, order)
    tiles = torch.arange(0, slots, block_m, device=ids.device)
    return pair_at, torch.searchsorted(ends, tiles, right=True)


@triton.jit
def _grouped_kernel(a_ptr, w_ptr, out_ptr, pair_ptr, expert_ptr, N, K, num_pairs, row_div, num_experts,
                    stride_am, stride_we, stride_wn, stride_om,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """out[pair] = a[pair // row_div] @ w[expert]^T for the pairs of one tile, one tile of N."""
    tile = tl.program_id(0)
    e = tl.load(expert_ptr + tile)
    if e < num_experts:
        pairs = tl.load(pair_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        rows = tl.where(valid, pairs // row_div, 0).to(tl.int64)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = w_ptr + e.to(tl.int64) * stride_we + tl.where(rn < N, rn, 0).to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + rows[:, None] * stride_am + rk[None, :], mask=valid[:, None] & (rk[None, :] < K),
                        other=0.0)
            w = tl.load(w_rows + rk[None, :], mask=rk[None, :] < K, other=0.0)
            if IEEE:
                acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:   # bfloat16 values are exact in tf32: its products on the same tensor cores, float32 sums
                acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="tf32")
        out = out_ptr + tl.where(valid, pairs, 0).to(tl.int64)[:, None] * stride_om + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (rn[None, :] < N))


def _grouped(a: torch.Tensor, w: torch.Tensor, pair_at: torch.Tensor, expert_of_tile: torch.Tensor,
             num_pairs: int, row_div: int, block_m: int) -> torch.Tensor:
    """[num_pairs, N]: row p = a[p // row_div] @ w[expert of p]^T."""
    n, k = w.shape[1], w.shape[2]
    out = torch.empty((num_pairs, n), dtype=a.dtype, device=a.device)
    grid = (expert_of_tile.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_kernel[grid](a, w, out, pair_at, expert_of_tile, n, k, num_pairs, row_div, w.shape[0],
                          a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                          BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=a.dtype == torch.float32)
    return out


def moe_experts_triton(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                       weights: torch.Tensor) -> torch.Tensor:
    """h [T, H], gate_up [E, 2I, H], down [E, H, I] (rows contiguous), ids / weights [T, k] -> [T, H]."""
    t, k = ids.shape
    if t == 0:
        return torch.empty_like(h)
    h, gate_up, down = h.contiguous(), gate_up.contiguous(), down.contiguous()
    block_m = 16 if t * k <= 256 else 64
    pair_at, expert_of_tile = sort_pairs(ids, gate_up.shape[0], block_m)
    up = _grouped(h, gate_up, pair_at, expert_of_tile, t * k, k, block_m)               # [T*k, 2I]
    y = _grouped(silu_and_mul(up), down, pair_at, expert_of_tile, t * k, 1, block_m)   # [T*k, H]
    return (y.view(t, k, -1).float() * weights[..., None].float()).sum(1).to(h.dtype)
