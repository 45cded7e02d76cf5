"""The KV store as a Triton kernel: write this step's K/V rows into the paged cache at their slots.

Owns: `store_kv_triton`, the kernel twin of kernels/attention.py's `store_kv` (the reference). Slot -1
(a padding token) writes nothing. Caches may be strided views of a larger region (the KV region's
per-layer views); only the last dimension must be contiguous. Never launched at import.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_heads,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kb, stride_ks, stride_kch, stride_vb, stride_vs, stride_vch,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                     PAGE: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    blk = slot // PAGE
    off = slot % PAGE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < num_heads)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + blk * stride_kb + off * stride_ks + h[:, None] * stride_kch + d[None, :], k, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(v_cache_ptr + blk * stride_vb + off * stride_vs + h[:, None] * stride_vch + d[None, :], v, mask=mask)


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    # k, v: [T, Hkv, D]; caches: [num_blocks, page, Hkv, D]; slot_mapping: [T] int64, -1 = nowhere
    num_tokens, hkv, d = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, hkv, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_H=triton.next_power_of_2(hkv), PAGE=k_cache.shape[1])
