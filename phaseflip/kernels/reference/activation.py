"""SiLU-and-mul and GELU(tanh)-and-mul, the torch references: the gated MLP's activation over a fused
gate_up projection (Llama's SwiGLU; Gemma's GeGLU, transformers' gelu_pytorch_tanh)."""
import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [T, 2*I] -> [T, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [T, 2*I] -> [T, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
