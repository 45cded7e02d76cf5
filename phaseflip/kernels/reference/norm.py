"""RMSNorm, the torch reference (used on CPU and as the oracle for the Triton kernel).

Computed in float32 and cast back, exactly as HF transformers' LlamaRMSNorm does, so fp32 greedy
parity holds and bf16 stays stable.
"""
import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., H], weight: [H]
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """residual += x; return (rms_norm(residual), residual). The fused kernel's reference."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual
