"""Rotary embedding as a Triton kernel: applies a gathered cos/sin row to every head of a token.

Owns: `apply_rotary_triton`, the kernel twin of kernels/reference/rotary.py's `apply_rotary` (the reference). The
table (default or llama3-scaled frequencies) is always built by kernels/reference/rotary.py's cos_sin_table: this
kernel only applies it, in the neox/HF half-split layout. Every product and sum is rounded to the input
dtype as the reference's elementwise torch ops do, so bf16 results match it bit for bit. Never launched
at import.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(x_ptr, cs_ptr, out_ptr, num_heads, stride_xt, stride_xh, stride_ct, stride_ot, stride_oh,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_HALF)
    c_ok = c < HALF
    mask = (h < num_heads)[:, None] & c_ok[None, :]
    dt = out_ptr.dtype.element_ty
    cos = tl.load(cs_ptr + t * stride_ct + c, mask=c_ok, other=0.0).to(dt).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + t * stride_ct + HALF + c, mask=c_ok, other=0.0).to(dt).to(tl.float32)[None, :]
    x_row = x_ptr + t * stride_xt + h[:, None] * stride_xh + c[None, :]
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = (x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)
    o2 = (x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)
    o_row = out_ptr + t * stride_ot + h[:, None] * stride_oh + c[None, :]
    tl.store(o_row, o1.to(dt), mask=mask)
    tl.store(o_row + HALF, o2.to(dt), mask=mask)


def apply_rotary_triton(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D] (any strides but the last); cos_sin: [T, D] float32 (cos | sin) -> [T, heads, D]
    num_tokens, heads, d = x.shape
    assert x.stride(-1) == 1 and cos_sin.stride(-1) == 1 and d % 2 == 0
    out = torch.empty((num_tokens, heads, d), dtype=x.dtype, device=x.device)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](x, cos_sin, out, heads, x.stride(0), x.stride(1), cos_sin.stride(0),
                                      out.stride(0), out.stride(1), HALF=d // 2,
                                      BLOCK_H=triton.next_power_of_2(heads),
                                      BLOCK_HALF=triton.next_power_of_2(d // 2))
    return out
