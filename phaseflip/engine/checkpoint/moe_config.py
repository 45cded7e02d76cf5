"""config.json's mixture-of-experts fields as a MoeConfig, and the expert tensors such a checkpoint holds.

Owns: `parse_moe` (Mixtral, Qwen2-MoE, Qwen3-MoE as transformers reads them), `moe_shapes` (each sparse
layer's router, experts and shared expert under the engine's names: `mlp.gate`, `mlp.experts.E.
{gate,up,down}_proj`, `mlp.shared_expert.*`, `mlp.shared_expert_gate`), and `file_names` / `engine_names`,
which turn Mixtral's names (`block_sparse_moe.gate`, `experts.E.w1/w3/w2`) into those and back. Builds on
loader.py's field readers (which imports this module at its call).
"""
from __future__ import annotations

from pathlib import Path

import torch

from phaseflip.engine.checkpoint.loader import CheckpointError, _int_field
from phaseflip.rank.model_config import ModelConfig, MoeConfig

# Mixtral's names -> the engine's (the Qwen MoE checkpoints use the engine's already)
_MIXTRAL = ((".block_sparse_moe.gate.", ".mlp.gate."), (".block_sparse_moe.experts.", ".mlp.experts."),
            (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def parse_moe(raw: dict, arch: str, path: Path) -> MoeConfig | None:
    """The MoE fields of an MoE architecture's config.json (None for a dense one)."""
    if arch == "MixtralForCausalLM":
        experts = _int_field(raw, "num_local_experts", path, 8)
        return MoeConfig(num_experts=experts, top_k=_top_k(raw, path, experts, 2),
                         expert_intermediate_size=_int_field(raw, "intermediate_size", path), norm_topk_prob=True)
    if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return None
    experts = _int_field(raw, "num_experts", path, raw.get("num_local_experts", 60 if "Qwen2" in arch else 128))
    step = _int_field(raw, "decoder_sparse_step", path, 1)
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise CheckpointError(f"{path}: field 'mlp_only_layers' must be a list of layer indices, got {only!r}")
    layers = _int_field(raw, "num_hidden_layers", path)
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    shared = _int_field(raw, "shared_expert_intermediate_size", path) if "Qwen2" in arch else 0
    try:
        return MoeConfig(num_experts=experts, top_k=_top_k(raw, path, experts, 4 if "Qwen2" in arch else 8),
                         expert_intermediate_size=_int_field(raw, "moe_intermediate_size", path),
                         norm_topk_prob=bool(raw.get("norm_topk_prob", False)), shared_intermediate_size=shared,
                         dense_layers=dense)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from e


def _top_k(raw: dict, path: Path, experts: int, default: int) -> int:
    k = _int_field(raw, "num_experts_per_tok", path, default)
    if k > experts:
        raise CheckpointError(f"{path}: field 'num_experts_per_tok'={k} exceeds the {experts} experts")
    return k


def moe_shapes(c: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """A sparse layer's MLP tensors (engine names) with their shapes."""
    m, H, p = c.moe, c.hidden_size, f"model.layers.{layer}.mlp."
    I = m.expert_intermediate_size
    shapes = {p + "gate.weight": (m.num_experts, H)}
    for e in range(m.num_experts):
        shapes.update({f"{p}experts.{e}.gate_proj.weight": (I, H), f"{p}experts.{e}.up_proj.weight": (I, H),
                       f"{p}experts.{e}.down_proj.weight": (H, I)})
    if m.shared_intermediate_size:
        S = m.shared_intermediate_size
        shapes.update({p + "shared_expert.gate_proj.weight": (S, H), p + "shared_expert.up_proj.weight": (S, H),
                       p + "shared_expert.down_proj.weight": (H, S), p + "shared_expert_gate.weight": (1, H)})
    return shapes


def file_names(shapes: dict[str, tuple[int, ...]], c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The names the architecture's file stores these tensors under."""
    if c.architecture != "MixtralForCausalLM":
        return shapes
    return {_rename(name, ((new, old) for old, new in _MIXTRAL)): s for name, s in shapes.items()}


def engine_names(weights: dict[str, torch.Tensor], c: ModelConfig) -> dict[str, torch.Tensor]:
    """A file's tensors under the engine's names (file_names undone)."""
    if c.architecture != "MixtralForCausalLM":
        return weights
    return {_rename(name, _MIXTRAL): t for name, t in weights.items()}


def _rename(name: str, pairs) -> str:
    if ".mlp." not in name and ".block_sparse_moe." not in name:
        return name
    for old, new in pairs:
        name = name.replace(old, new)
    return name
