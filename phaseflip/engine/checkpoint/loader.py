"""The checkpoint loader: an HF-format model directory -> ModelConfig, validated weights, Tokenizer.

Owns: reading config.json (ModelConfig), *.safetensors (+ model.safetensors.index.json) into a dict of HF
tensor names, checking every tensor the architecture needs against shapes computed from the config,
choosing the compute dtype. The tokenizer lives in engine/checkpoint/tokenizer.py.
Every defect of a checkpoint is a CheckpointError that names the file and the field or tensor.

It never imports transformers, never touches a device other than the CPU, and never shards or packs
weights (rank/weights.py and rank/arena.py do that from the dict returned here).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from phaseflip.engine.checkpoint.fused import fused_shapes, unfused
from phaseflip.rank.model_config import ARCHITECTURES, ModelConfig

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"

# HF defaults (transformers 5 configuration_*.py) for fields a config.json may omit.
_DEFAULTS = {
    "LlamaForCausalLM": dict(max_position_embeddings=2048, head_dim=None, sliding_window=None),
    "MistralForCausalLM": dict(max_position_embeddings=4096 * 32, head_dim=None, sliding_window=4096),
    "Qwen2ForCausalLM": dict(max_position_embeddings=32768, head_dim=None, sliding_window=None),
    "Qwen3ForCausalLM": dict(max_position_embeddings=32768, head_dim=128, sliding_window=None),
    "Phi3ForCausalLM": dict(max_position_embeddings=4096, head_dim=None, sliding_window=None),
    "MixtralForCausalLM": dict(max_position_embeddings=4096 * 32, head_dim=None, sliding_window=None),
    "Qwen2MoeForCausalLM": dict(max_position_embeddings=32768, head_dim=None, sliding_window=None),
    "Qwen3MoeForCausalLM": dict(max_position_embeddings=32768, head_dim=None, sliding_window=None),
    "Gemma2ForCausalLM": dict(max_position_embeddings=8192, head_dim=256, sliding_window=4096),
    "Gemma3ForCausalLM": dict(max_position_embeddings=131072, head_dim=256, sliding_window=4096),
}

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


class CheckpointError(ValueError):
    """A model directory that cannot be loaded; the message names the file and the field or tensor."""


# ---------------------------------------------------------------------------------------------- config

def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse <model_dir>/config.json into a ModelConfig (HF defaults for omitted optional fields); a GGUF
    file's from its metadata (gguf_model.py)."""
    from phaseflip.engine.checkpoint import gguf_model   # it builds on this module
    if gguf_model.is_gguf(model_dir):
        return gguf_model.load_gguf_config(model_dir)
    if not Path(model_dir).exists():
        raise CheckpointError(f"{model_dir}: no such file or directory (a model is a directory with "
                              f"{CONFIG_FILE}, or a .gguf file)")
    if Path(model_dir).is_file():
        raise CheckpointError(f"{model_dir}: a file that is not GGUF (no GGUF magic); a model is a directory "
                              f"with {CONFIG_FILE}, or a .gguf file")
    path = Path(model_dir) / CONFIG_FILE
    raw = read_json(path)
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise CheckpointError(f"{path}: missing required field 'architectures'")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: field 'architectures' names unsupported architecture {arch!r}; "
                              f"supported: {', '.join(ARCHITECTURES)}")
    defaults = _DEFAULTS[arch]
    _check_unsupported(raw, arch, path)
    num_heads = _int_field(raw, "num_attention_heads", path)
    hidden = _int_field(raw, "hidden_size", path)
    head_dim = _int_field(raw, "head_dim", path, defaults["head_dim"] or hidden // num_heads)
    from phaseflip.engine.checkpoint.gemma_config import gemma_rope, parse_gemma   # these build on this module
    from phaseflip.engine.checkpoint.moe_config import parse_moe
    from phaseflip.engine.checkpoint.rope_config import longrope_context, parse_rope
    rope_theta, rope_scaling = parse_rope(gemma_rope(raw, arch), path)
    max_pos = _int_field(raw, "max_position_embeddings", path, defaults["max_position_embeddings"])
    max_pos = min(max_pos, longrope_context(raw) or max_pos)   # past it LongRoPE re-rotates cached keys
    fields = dict(
        architecture=arch,
        vocab_size=_int_field(raw, "vocab_size", path),
        hidden_size=hidden,
        intermediate_size=_int_field(raw, "intermediate_size", path),
        num_layers=_int_field(raw, "num_hidden_layers", path),
        num_heads=num_heads,
        num_kv_heads=_int_field(raw, "num_key_value_heads", path, num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(_number_field(raw, "rms_norm_eps", path, 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM" and raw.get("qkv_bias", True)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
        rope_scaling=rope_scaling,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id"), path),
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        moe=parse_moe(raw, arch, path),
        windows=_windows(raw, arch, path, max_pos),
        gemma=parse_gemma(raw, arch, path),
    )
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from e


def _check_unsupported(raw: dict, arch: str, path: Path) -> None:
    """Options that change the maths in ways ModelConfig cannot describe are refused, never ignored."""
    _check_not_quantized(raw, path)
    if not arch.startswith("Gemma") and raw.get("hidden_act", "silu") != "silu":   # Gemma's: gemma_config.py
        raise CheckpointError(f"{path}: field 'hidden_act'={raw['hidden_act']!r} is not supported (only 'silu')")
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"{path}: field 'partial_rotary_factor'={raw['partial_rotary_factor']!r} is not "
                              "supported (the rotary covers the whole head: only 1.0)")
    # Llama/Qwen3 attention_bias puts a bias on o_proj as well as q/k/v; Llama mlp_bias on the MLP.
    for name in ("attention_bias", "mlp_bias"):
        if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and raw.get(name):
            raise CheckpointError(f"{path}: field {name!r}=true is not supported for {arch}")


def _check_not_quantized(raw: dict, path: Path) -> None:
    """A quantized HF checkpoint (GPTQ, AWQ, FP8, compressed-tensors, bitsandbytes...) stores packed integers
    and scales the loader would read as plain weights or drop: refuse it before any tensor is read."""
    for field in ("quantization_config", "compression_config"):
        if field not in raw:
            continue
        spec = raw[field] if isinstance(raw[field], dict) else {}
        method = spec.get("quant_method") or spec.get("format") or "unnamed"
        raise CheckpointError(f"{path}: field {field!r} declares a quantized checkpoint (method {method!r}), which "
                              "is not served; allowed: unquantized safetensors (float32, bfloat16, float16)")


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


_REQUIRED = object()


def _number_field(raw: dict, name: str, path: Path, default=_REQUIRED):
    value = raw.get(name)
    if value is None:
        if default is _REQUIRED:
            raise CheckpointError(f"{path}: missing required field {name!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(f"{path}: field {name!r} must be a number, got {value!r}")
    return value


def _int_field(raw: dict, name: str, path: Path, default=_REQUIRED) -> int:
    """A size or count: every integer field of config.json that ModelConfig takes is one."""
    value = _number_field(raw, name, path, default)
    if not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{path}: field {name!r} must be a positive integer, got {value!r}")
    return value


def _eos_ids(value, path: Path) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(f"{path}: field 'eos_token_id' must be an int or a list of ints, got {value!r}")
    return tuple(ids)


def _windows(raw: dict, arch: str, path: Path, max_pos: int) -> tuple[int, ...]:
    """Each layer's sliding window as transformers sets it (0: full attention; (): no layer has one that
    the context can outgrow): a config's layer_types, else Mistral's, Mixtral's and Phi-3's sliding_window
    on every layer, Qwen's on the layers from max_window_layers on where use_sliding_window."""
    layers = _int_field(raw, "num_hidden_layers", path)
    window = raw.get("sliding_window", _DEFAULTS[arch]["sliding_window"])
    if arch.startswith("Qwen") and not raw.get("use_sliding_window", False):
        window = None
    if not window:
        return ()
    window = _int_field(raw, "sliding_window", path)
    if window >= max_pos:
        return ()
    types = raw.get("layer_types")
    if types is None and arch.startswith("Gemma"):
        from phaseflip.engine.checkpoint.gemma_config import gemma_windows
        types = gemma_windows(raw, arch, layers)
    elif types is None:
        first = _int_field(raw, "max_window_layers", path, 28) if arch.startswith("Qwen") else 0
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or \
            not set(types) <= {"sliding_attention", "full_attention"}:
        raise CheckpointError(f"{path}: field 'layer_types' must list 'sliding_attention' or 'full_attention' "
                              f"for each of the {layers} layers, got {types!r}")
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


# ---------------------------------------------------------------------------------------------- dtype

def resolve_dtype(dtype: str | torch.dtype, device: str, checkpoint_dtype: str | None = None) -> torch.dtype:
    """The compute dtype. "auto": float32 on CPU; on CUDA the checkpoint's bf16/fp16, else bfloat16."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; allowed: {', '.join(_DTYPES)}, auto")
        return dtype
    if dtype == "auto":
        if not str(device).startswith("cuda"):
            return torch.float32
        return _DTYPES[checkpoint_dtype] if checkpoint_dtype in ("bfloat16", "float16") else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; allowed: {', '.join(_DTYPES)}, auto")
    return _DTYPES[dtype]


# ---------------------------------------------------------------------------------------------- weights

def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor (HF name) the architecture's checkpoint holds, with its shape (fused ones fused, an
    MoE's experts under the file's names)."""
    from phaseflip.engine.checkpoint.gemma_config import gemma_shapes   # these build on this module
    from phaseflip.engine.checkpoint.moe_config import file_names, moe_shapes
    c = config
    H, q_out, kv_out = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, H), "model.norm.weight": (H,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, H)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (q_out, H),
            p + "self_attn.k_proj.weight": (kv_out, H),
            p + "self_attn.v_proj.weight": (kv_out, H),
            p + "self_attn.o_proj.weight": (H, q_out),
        })
        shapes.update(moe_shapes(c, i) if c.is_sparse(i) else {
            p + "mlp.gate_proj.weight": (c.intermediate_size, H),
            p + "mlp.up_proj.weight": (c.intermediate_size, H),
            p + "mlp.down_proj.weight": (H, c.intermediate_size),
        })
        if c.gemma:
            shapes.update(gemma_shapes(c, i))
        if c.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q_out,), p + "self_attn.k_proj.bias": (kv_out,),
                           p + "self_attn.v_proj.bias": (kv_out,)})
        if c.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (c.head_dim,),
                           p + "self_attn.k_norm.weight": (c.head_dim,)})
    return file_names(fused_shapes(shapes, c), c)


def load_weights(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Read the checkpoint's tensors (HF names) cast to dtype, after checking every needed one is there;
    a GGUF file's quantized tensors stay in their blocks (gguf_model.py)."""
    from phaseflip.engine.checkpoint import gguf_model   # it builds on this module
    if gguf_model.is_gguf(model_dir):
        return gguf_model.load_gguf_weights(model_dir, config, dtype)
    model_dir = Path(model_dir)
    expected = expected_tensor_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    files = safetensors_files(model_dir)
    for path in files:
        for name, tensor in _read_file(path, expected).items():
            if name in origin:
                raise CheckpointError(f"{path}: tensor {name!r} is also in {origin[name]}")
            weights[name], origin[name] = tensor.to(dtype), path
    missing = [name for name in expected if name not in weights]
    if missing:
        read = ", ".join(f.name for f in files)
        raise CheckpointError(f"{model_dir}: tensor {missing[0]!r} is missing from the checkpoint "
                              f"({len(missing)} missing in all; read: {read})")
    from phaseflip.engine.checkpoint.gemma_config import plus_one
    from phaseflip.engine.checkpoint.moe_config import engine_names
    return plus_one(engine_names(unfused(weights, config), config), config)


def check_shapes(path: Path, shapes: dict[str, tuple[int, ...]], config: ModelConfig) -> None:
    """Every tensor the architecture needs is among `shapes` (HF names, the file's shapes), with the
    shape the config gives it."""
    expected = expected_tensor_shapes(config)
    for name, shape in expected.items():
        if name not in shapes:
            raise CheckpointError(f"{path}: tensor {name!r} is missing")
        if tuple(shapes[name]) != shape:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(shapes[name])}, expected {shape}")


def safetensors_files(model_dir: Path) -> list[Path]:
    """The files the index names (when there is one), else every *.safetensors in the directory."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: missing required field 'weight_map'")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index}: names {f.name!r}, which is not in {model_dir}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files (and no {INDEX_FILE})")
    return files


def _read_file(path: Path, expected: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The tensors of one file that are in `expected`, shapes checked from the header before any data is
    read; extras (a rotary inv_freq, a tied lm_head) are skipped."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names = [name for name in f.keys() if name in expected]
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise CheckpointError(f"{path}: tensor {name!r} has shape {shape}, expected {expected[name]}")
            return {name: f.get_tensor(name) for name in names}
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors file (truncated or corrupt?): {e}") from e


# ---------------------------------------------------------------------------------------------- tokenizer
