"""Which implementation a kernel call runs: the Triton kernels on CUDA tensors, the torch references
everywhere else (the CPU path, and the oracle the kernels are tested against).

Owns: the entry points the model maths calls for the pointwise kernels (`rms_norm`, `add_rms_norm`,
`apply_rotary`, `silu_and_mul`), and the torch.library custom ops that wrap their Triton launches so
torch.compile treats each as one opaque call and a CUDA graph captures it. Attention and the KV store
dispatch inside `phaseflip::paged_attention` itself (kernels/attention.py).

The branch is on `x.is_cuda` only, a static property torch.compile specialises on. Triton is imported
at the first CUDA call, never at import; without triton a CUDA call falls back to the reference (eager
only: the attention reference synchronises with the host, so it cannot be captured).
"""
from __future__ import annotations

import importlib.util

import torch

from phaseflip.kernels import activation, norm, rotary

_triton_available: bool | None = None


def triton_available() -> bool:
    """Whether triton can be imported (looked up once, without importing it)."""
    global _triton_available
    if _triton_available is None:
        _triton_available = importlib.util.find_spec("triton") is not None
    return _triton_available


# -- entry points the model calls ------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda:
        return torch.ops.phaseflip.rms_norm(x, weight, eps)
    return norm.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual + x -> (rms_norm(sum), sum): the residual add fused into the next norm."""
    if x.is_cuda:
        return torch.ops.phaseflip.add_rms_norm(x, residual, weight, eps)
    return norm.add_rms_norm(x, residual, weight, eps)


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return torch.ops.phaseflip.apply_rotary(x, cos_sin)
    return rotary.apply_rotary(x, cos_sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.is_cuda:
        return torch.ops.phaseflip.silu_and_mul(gate_up)
    return activation.silu_and_mul(gate_up)


# -- the custom ops (CUDA bodies; registered at import like phaseflip::paged_attention) --------------
@torch.library.custom_op("phaseflip::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not triton_available():
        return norm.rms_norm(x, weight, eps)
    from phaseflip.kernels.triton_norm import rms_norm_triton
    return rms_norm_triton(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)


@torch.library.custom_op("phaseflip::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not triton_available():
        return norm.add_rms_norm(x, residual, weight, eps)
    from phaseflip.kernels.triton_norm import add_rms_norm_triton
    return add_rms_norm_triton(x, residual, weight, eps)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    res_dtype = torch.promote_types(x.dtype, residual.dtype)
    return (torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, res_dtype), device=x.device),
            torch.empty(x.shape, dtype=res_dtype, device=x.device))


@torch.library.custom_op("phaseflip::apply_rotary", mutates_args=())
def _apply_rotary_op(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    if not triton_available():
        return rotary.apply_rotary(x, cos_sin)
    from phaseflip.kernels.triton_rotary import apply_rotary_triton
    return apply_rotary_triton(x, cos_sin)


@_apply_rotary_op.register_fake
def _(x, cos_sin):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("phaseflip::silu_and_mul", mutates_args=())
def _silu_and_mul_op(gate_up: torch.Tensor) -> torch.Tensor:
    if not triton_available():
        return activation.silu_and_mul(gate_up)
    from phaseflip.kernels.triton_activation import silu_and_mul_triton
    return silu_and_mul_triton(gate_up)


@_silu_and_mul_op.register_fake
def _(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))
