"""Mixture-of-experts routing and expert products, the torch reference: the oracle the grouped kernels
(kernels/cpu/moe.py, kernels/triton/moe.py) are tested against, written the plainest way.

Owns: `route` (router logits -> each token's top-k experts and their weights, as transformers' Mixtral and
Qwen MoE routers compute them) and `experts` (every expert over every token, weighted by how much each
token routes to it: E / k times the needed work, and no data-dependent shape).
"""
from __future__ import annotations

import torch

from phaseflip.kernels.reference.activation import silu_and_mul


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights float32 [T, k], expert ids int64 [T, k]): softmax over every expert in
    float32, the top k, renormalised to sum to 1 where `normalize`."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
    """sum over each token's chosen experts e of weight * down_e(silu(gate_e h) * up_e h).
    h [T, H], gate_up [E, 2I, H] (gate rows then up rows), down [E, H, I], ids / weights [T, k] -> [T, H]."""
    num_experts = gate_up.shape[0]
    combine = torch.zeros(h.shape[0], num_experts, dtype=torch.float32, device=h.device)
    combine.scatter_add_(1, ids, weights.float())                         # [T, E]
    out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    for e in range(num_experts):
        y = silu_and_mul(h @ gate_up[e].t()) @ down[e].t()                 # [T, H]
        out += combine[:, e:e + 1] * y.float()
    return out.to(h.dtype)
