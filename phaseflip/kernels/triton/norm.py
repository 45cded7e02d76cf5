"""RMSNorm and fused residual-add + RMSNorm as one Triton kernel (one program per row).

Owns: `rms_norm_triton` and `add_rms_norm_triton`, the kernel twins of kernels/reference/norm.py (the
references). The rounding follows the references step by step: the residual sum is rounded to the
residual dtype, the normalised row is computed in float32 and rounded to the input dtype, then
multiplied by the weight. Never launched at import.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < n_cols
    x = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + c, mask=ok, other=0.0).to(tl.float32)
        x = (x + r).to(res_out_ptr.dtype.element_ty)      # residual += x, in the residual dtype
        tl.store(res_out_ptr + row * stride_ro + c, x, mask=ok)
        x = x.to(tl.float32)
    var = tl.sum(x * x, 0) / n_cols
    xn = (x * tl.math.rsqrt(var + eps)).to(res_out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, (xn * w).to(out_ptr.dtype.element_ty), mask=ok)


def _launch(x2, res2, weight, eps, res_out):
    # x2, res2, res_out: [R, H] with contiguous rows; returns the normed [R, H]
    rows, cols = x2.shape
    out = torch.empty((rows, cols), dtype=torch.promote_types(weight.dtype, res_out.dtype), device=x2.device)
    if rows:
        has_res = res2 is not None
        r = res2 if has_res else x2
        _rms_norm_kernel[(rows,)](x2, r, weight, out, res_out, cols, eps, x2.stride(0), r.stride(0),
                                  out.stride(0), res_out.stride(0), BLOCK=triton.next_power_of_2(cols),
                                  HAS_RESIDUAL=has_res)
    return out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., H], weight: [H]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    # without a residual the kernel only reads res_out's dtype (the input dtype) and never writes it
    return _launch(x2, None, weight, eps, x2).view(*x.shape[:-1], x.shape[-1])


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """residual + x -> (rms_norm(sum), sum); x, residual: [..., H]."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    r2 = residual.reshape(-1, residual.shape[-1]).contiguous()
    res_out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    out = _launch(x2, r2, weight, eps, res_out)
    return out.view(*x.shape[:-1], x.shape[-1]), res_out.view(*x.shape[:-1], x.shape[-1])
