"""Checkpoints that store projections fused: which architectures (Phi-3: q/k/v as one qkv_proj, gate/up
as one gate_up_proj, rows in that order), the names and shapes such a file holds, and its tensors handed
on as row views under the separate names the engine shards (no copy; a quantized tensor's rows are rows
of blocks).

Owns: `FUSED_IN_FILE`, `FUSIONS`, `fused_shapes`, `unfused`. The loader (safetensors) and gguf_model
(llama.cpp's attn_qkv / ffn_up) both use it.
"""
from __future__ import annotations

import torch

from phaseflip.rank.model_config import ModelConfig

FUSED_IN_FILE = ("Phi3ForCausalLM",)
FUSIONS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


def fused_shapes(shapes: dict[str, tuple[int, ...]], c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The file's names and shapes: for an architecture that stores q/k/v and gate/up fused, theirs
    replaced by the fused tensors' (their rows stacked)."""
    if c.architecture not in FUSED_IN_FILE:
        return shapes
    out = {}
    for name, shape in shapes.items():
        for fused, parts in FUSIONS:
            part = next((p for p in parts if name.endswith(f".{p}.weight")), None)
            if part is not None:
                name = name.replace(f".{part}.", f".{fused}.")
                shape = (out.get(name, (0,))[0] + shape[0], *shape[1:])
        out[name] = shape
    return out


def unfused(weights: dict[str, torch.Tensor], c: ModelConfig) -> dict[str, torch.Tensor]:
    """A fused file's tensors under the separate names, as row views of the fused ones (no copy; a
    quantized one's rows are rows of blocks); the weights as they are for an architecture stored apart."""
    if c.architecture not in FUSED_IN_FILE:
        return weights
    rows = {"qkv_proj": [c.num_heads * c.head_dim] + [c.num_kv_heads * c.head_dim] * 2,
            "gate_up_proj": [c.intermediate_size] * 2}
    out = {}
    for name, t in weights.items():
        fused = next(((f, parts) for f, parts in FUSIONS if name.endswith(f".{f}.weight")), None)
        if fused is None:
            out[name] = t
            continue
        out.update(zip((name.replace(fused[0], p) for p in fused[1]), t.split(rows[fused[0]])))
    return out
