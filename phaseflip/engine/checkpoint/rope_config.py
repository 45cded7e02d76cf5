"""config.json's rope fields as a ModelConfig's rope_theta and scaling: rope_parameters (transformers 5)
or the legacy rope_theta + rope_scaling; llama3, linear, yarn, dynamic and longrope scalings as transformers
computes them for the positions the engine serves (dynamic NTK changes nothing within
max_position_embeddings; LongRoPE is served within its original context, with its short factors); a
partial rotary refused by name.

Owns: `parse_rope`, `longrope_context`. Builds on loader.py's field readers (which imports this module at its call).
"""
from __future__ import annotations

import math
from pathlib import Path

from phaseflip.engine.checkpoint.loader import CheckpointError, _int_field, _number_field
from phaseflip.rank.model_config import FrequencyFactors, LinearRope, RopeScaling, YarnRope

DEFAULT_ROPE_THETA = 10_000.0
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def parse_rope(raw: dict, path: Path) -> tuple[float, RopeScaling | None]:
    """rope_parameters (transformers 5) wins; else legacy rope_theta + rope_scaling."""
    if isinstance(raw.get("rope_parameters"), dict):
        field, params = "rope_parameters", dict(raw["rope_parameters"])
        params.setdefault("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA))
    else:
        field, params = "rope_scaling", dict(raw.get("rope_scaling") or {})
        params["rope_theta"] = raw.get("rope_theta", DEFAULT_ROPE_THETA)
    if any(isinstance(v, dict) for v in params.values()):
        raise CheckpointError(f"{path}: field {field!r} holds per-layer-type parameters, which are not supported")
    theta = float(_number_field(params, "rope_theta", path, DEFAULT_ROPE_THETA))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"{path}: field {field!r} has partial_rotary_factor="
                              f"{params['partial_rotary_factor']!r}, which is not supported (the rotary covers "
                              "the whole head: only 1.0)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "dynamic":   # transformers' NTK base grows only past max_position_embeddings, never served
        _number_field(params, "factor", path)
        return theta, None
    if rope_type == "default":
        return theta, None
    if rope_type not in ("llama3", "linear", "yarn", "longrope"):
        raise CheckpointError(f"{path}: field {field!r} has unsupported rope_type {rope_type!r}; "
                              "supported: 'default', 'llama3', 'linear', 'yarn', 'dynamic', 'longrope'")
    if rope_type == "longrope":
        return theta, _longrope(params, raw, path)
    if rope_type == "linear":
        return theta, LinearRope(factor=float(_number_field(params, "factor", path)))
    if rope_type == "yarn":
        return theta, _yarn(params, raw, path)
    missing = [k for k in LLAMA3_ROPE_KEYS if k not in params]
    if missing:
        raise CheckpointError(f"{path}: field {field!r} (llama3) is missing {', '.join(missing)}")
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def longrope_context(raw: dict) -> int | None:
    """The context a LongRoPE model is served to: its original_max_position_embeddings (past it transformers
    switches every position of the sequence to the long factors, keys already cached included, which a KV
    cache cannot follow); None for another rope."""
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else raw.get("rope_scaling")
    if not isinstance(params, dict) or params.get("rope_type", params.get("type")) != "longrope":
        return None
    original = params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
    return int(original) if isinstance(original, int) and original > 0 else None


def _longrope(params: dict, raw: dict, path: Path) -> FrequencyFactors:
    """LongRoPE as transformers computes it for a sequence within the original context: each frequency
    divided by its short factor, cos and sin times the attention factor (from max_position_embeddings over
    the original context unless given)."""
    original = longrope_context(raw)
    if original is None:
        raise CheckpointError(f"{path}: longrope needs original_max_position_embeddings (a positive integer)")
    heads = _int_field(raw, "num_attention_heads", path)
    head_dim = raw.get("head_dim") or _int_field(raw, "hidden_size", path) // heads
    short, long = params.get("short_factor"), params.get("long_factor")
    for name, factors in (("short_factor", short), ("long_factor", long)):
        if not isinstance(factors, list) or len(factors) != head_dim // 2 or \
                not all(isinstance(f, (int, float)) and f > 0 for f in factors):
            raise CheckpointError(f"{path}: longrope's {name} must list {head_dim // 2} positive numbers "
                                  f"(one per rotary frequency), got {factors!r}")
    factor = params.get("factor") or _int_field(raw, "max_position_embeddings", path) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return FrequencyFactors(tuple(float(f) for f in short), attention_factor=float(attention))


def _yarn(params: dict, raw: dict, path: Path) -> YarnRope:
    """YaRN's parameters as transformers reads them: factor defaults to max_position_embeddings over the
    original context; attention_factor, unless given, from mscale (and mscale_all_dim)."""
    original = _int_field(params, "original_max_position_embeddings", path)
    factor = float(_number_field(params, "factor", path, _int_field(raw, "max_position_embeddings", path) / original))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return YarnRope(factor=factor, original_max_position_embeddings=original, attention_factor=float(attention),
                    beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                    truncate=bool(params.get("truncate", True)))
