"""config.json's Gemma 2/3 fields as a GemmaStyle, the tensors such a checkpoint adds, and its norms read
as the engine applies them.

Owns: `parse_gemma` (activation, query_pre_attn_scalar, the soft-caps; Gemma 3's rope per layer type as
transformers 5 writes it, or the legacy rope_theta + rope_local_base_freq), `gemma_rope` (the rope the
full-attention layers take), `gemma_windows` (transformers' default layer types: Gemma 2 alternates sliding
and full from layer 0, Gemma 3 makes every sliding_window_pattern-th layer full), `gemma_shapes` (the
pre- and post-feedforward norms of each layer) and `plus_one` (every RMSNorm weight w read as 1 + w, added
in float32: Gemma's norm multiplies by (1 + w)). Builds on loader.py's field readers (which imports this
module at its call).
"""
from __future__ import annotations

from pathlib import Path

import torch

from phaseflip.engine.checkpoint.loader import CheckpointError, _number_field
from phaseflip.rank.model_config import GEMMA_ARCHITECTURES, GemmaStyle, ModelConfig

ACTIVATION = "gelu_pytorch_tanh"


def parse_gemma(raw: dict, arch: str, path: Path) -> GemmaStyle | None:
    """Gemma's fields (None for another architecture); what changes the maths beyond them is refused."""
    if arch not in GEMMA_ARCHITECTURES:
        return None
    act = raw.get("hidden_activation") or raw.get("hidden_act") or ACTIVATION
    if act != ACTIVATION:
        raise CheckpointError(f"{path}: field 'hidden_activation'={act!r} is not supported (only {ACTIVATION!r})")
    if raw.get("use_bidirectional_attention"):
        raise CheckpointError(f"{path}: field 'use_bidirectional_attention'=true is not supported (causal only)")
    if raw.get("attention_bias"):
        raise CheckpointError(f"{path}: field 'attention_bias'=true is not supported for {arch}")
    local = None
    if arch == "Gemma3ForCausalLM":
        params = raw.get("rope_parameters")
        sliding = params.get("sliding_attention") if isinstance(params, dict) else None
        if isinstance(sliding, dict):
            if sliding.get("rope_type", "default") != "default":
                raise CheckpointError(f"{path}: field 'rope_parameters' gives the sliding layers rope_type "
                                      f"{sliding['rope_type']!r}; supported there: 'default'")
            local = float(_number_field(sliding, "rope_theta", path, 10_000.0))
        else:
            local = float(_number_field(raw, "rope_local_base_freq", path, 10_000.0))
    return GemmaStyle(query_pre_attn_scalar=float(_number_field(raw, "query_pre_attn_scalar", path, 256)),
                      attn_softcap=float(raw.get("attn_logit_softcapping") or 0.0),
                      final_softcap=float(raw.get("final_logit_softcapping") or 0.0), local_rope_theta=local)


def gemma_rope(raw: dict, arch: str) -> dict:
    """The config as parse_rope should read it: Gemma 3's full-attention rope where rope_parameters holds
    one per layer type (another architecture's as it is)."""
    params = raw.get("rope_parameters")
    if arch == "Gemma3ForCausalLM" and isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        return {**raw, "rope_parameters": params["full_attention"]}
    return raw


def gemma_windows(raw: dict, arch: str, layers: int) -> list[str]:
    """transformers' layer types where config.json has none."""
    if arch == "Gemma2ForCausalLM":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    pattern = int(raw.get("sliding_window_pattern", 6))
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def gemma_shapes(c: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """A Gemma layer's norms beside the Llama ones (its post_attention_layernorm is the attention output's)."""
    p = f"model.layers.{layer}."
    return {p + "pre_feedforward_layernorm.weight": (c.hidden_size,),
            p + "post_feedforward_layernorm.weight": (c.hidden_size,)}


def plus_one(weights: dict[str, torch.Tensor], c: ModelConfig) -> dict[str, torch.Tensor]:
    """Every RMSNorm weight w as 1 + w (added in float32, then in the weights' dtype) for Gemma."""
    if c.gemma is None:
        return weights
    return {name: (t.float() + 1.0).to(t.dtype) if name.endswith("norm.weight") else t for name, t in weights.items()}
