"""SiLU-and-mul as a Triton kernel: [T, 2I] (gate | up) -> silu(gate) * up, [T, I].

Owns: `silu_and_mul_triton`, the kernel twin of kernels/reference/activation.py (the reference). silu(gate) is
rounded to the input dtype before the product, as the reference's two torch ops do. Never launched at
import.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < n_cols
    dt = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + t * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + n_cols + c, mask=ok, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + t * stride_o + c, (silu * up).to(dt), mask=ok)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [..., 2*I] -> [..., I]
    lead, width = gate_up.shape[:-1], gate_up.shape[-1]
    n = width // 2
    assert width == 2 * n
    gate_up = gate_up.reshape(-1, width)
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    num_tokens = gate_up.shape[0]
    out = torch.empty((num_tokens, n), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens and n:
        block = min(BLOCK, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0),
                                                                   out.stride(0), BLOCK=block)
    return out.view(*lead, n)
