"""A GGUF file as a model: its config from the metadata, its weights under HF's names with the quantized
ones kept in their blocks, and where its tokenizer is.

Owns: `is_gguf` (a path names a GGUF file), `load_gguf_config` (ModelConfig from the `<arch>.*` keys of
llama, mistral, qwen2, qwen3 and phi3 files; a sliding window on every layer),
`load_gguf_weights` (HF-named tensors: F32 / F16 / BF16 cast to the compute dtype; the block formats of
kernels/cpu/quant.py as uint8 [rows, blocks, block bytes], the layout the quantized products read; phi3's
fused attn_qkv and ffn_up handed on as row views under the separate names), `quantized_types`,
`column_units` (the blocks a TP split of o_proj and down_proj must keep whole) and `gguf_tokenizer_dir`
(the tokenizer's files, written once: gguf_tokenizer.py builds a byte-level BPE vocabulary).
llama.cpp's converter interleaves the rows of a llama's q and k projections for its rotary; they are put
back in HF's order here, whole rows of blocks at a time (a permutation of rows never touches a block).
What the engine cannot serve as the file has it (another architecture, rope scaling, a tensor type
without a kernel) is a CheckpointError naming it, raised before any weight is read.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from phaseflip.engine.checkpoint.gguf_file import MAGIC, read_gguf, type_name
from phaseflip.engine.checkpoint import gguf_tokenizer
from phaseflip.engine.checkpoint.gguf_tensors import FLOAT_TYPES, read_tensors
from phaseflip.engine.checkpoint.fused import unfused
from phaseflip.engine.checkpoint.loader import CheckpointError, check_shapes
from phaseflip.kernels.cpu.quant import FORMATS
from phaseflip.rank.model_config import FrequencyFactors, ModelConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}
PERMUTED_QK = ("llama", "mistral")   # llama.cpp's converter interleaves these families' q/k rows
# GGUF tensor names -> HF's (the layer part of each)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
}
_MODEL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
# Phi-3's fused tensors: q/k/v rows in attn_qkv, gate/up rows in ffn_up (as its HF checkpoint fuses them)
_FUSED_NAMES = {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}


def is_gguf(path: str | Path) -> bool:
    """Whether path is a file that starts with GGUF's magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


def _field(file, key: str, default=None):
    return file.metadata.get(key, default)


def load_gguf_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of the GGUF file at path, from its metadata."""
    path = Path(path)
    file = read_gguf(path)
    arch = _field(file, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: general.architecture={arch!r} is not served; "
                              f"served: {', '.join(ARCHITECTURES)}")
    if int(_field(file, f"{arch}.expert_count", 0) or 0):   # llama.cpp writes a Mixtral as a "llama"
        raise CheckpointError(f"{path}: {arch}.expert_count={_field(file, f'{arch}.expert_count')}: a mixture of "
                              "experts in a GGUF file is not served; serve its safetensors checkpoint")
    scaling = _field(file, f"{arch}.rope.scaling.type", "none")
    factors = [n for n in file.tensors if n.startswith("rope_factors")]   # Phi-3's longrope pair
    if scaling not in ("none", "llama3") or factors:
        raise CheckpointError(f"{path}: rope scaling ({scaling if scaling != 'none' else factors[0]}) in a GGUF "
                              "file is not served; allowed: plain rope, llama3's rope_freqs")

    def need(key: str):
        value = _field(file, f"{arch}.{key}")
        if value is None:
            raise CheckpointError(f"{path}: metadata key {arch}.{key} is missing")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    names = file.tensors
    if "token_embd.weight" not in names:
        raise CheckpointError(f"{path}: tensor 'token_embd.weight' is missing")
    vocab = _field(file, f"{arch}.vocab_size") or names["token_embd.weight"].dims[-1]
    eos = _field(file, "tokenizer.ggml.eos_token_id")
    head_dim = int(_field(file, f"{arch}.attention.key_length", hidden // heads))
    rotary = int(_field(file, f"{arch}.rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise CheckpointError(f"{path}: {arch}.rope.dimension_count={rotary} rotates part of the {head_dim}-value "
                              "head, which is not served (the rotary covers the whole head)")
    rope_scaling = _frequency_factors(path, file, head_dim)
    max_pos = int(need("context_length"))
    layers = int(need("block_count"))
    window = int(_field(file, f"{arch}.attention.sliding_window", 0) or 0)   # on every layer, as llama.cpp reads it
    try:
        return ModelConfig(
            architecture=ARCHITECTURES[arch], vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")), num_layers=layers,
            num_heads=heads, num_kv_heads=int(_field(file, f"{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=float(_field(file, f"{arch}.rope.freq_base", 10_000.0)), rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings="output.weight" not in names, qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3",
            bos_token_id=_field(file, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),), torch_dtype=None,
            windows=(window,) * layers if 0 < window < max_pos else ())
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from e


def _frequency_factors(path: Path, file, head_dim: int) -> FrequencyFactors | None:
    """llama3 scaling as llama.cpp's converter stores it: rope_freqs, one divisor per rotary frequency."""
    info = file.tensors.get("rope_freqs.weight")
    if info is None:
        return None
    if info.type_id != 0 or info.dims != (head_dim // 2,):
        raise CheckpointError(f"{path}: tensor 'rope_freqs.weight' is {type_name(info.type_id)} {info.dims}; "
                              f"expected F32 ({head_dim // 2},), one factor per rotary frequency")
    values = file.mapped()[info.offset:info.offset + info.num_bytes].view("<f4")
    return FrequencyFactors(tuple(float(v) for v in values))


def hf_name(gguf_name: str, arch: str | None = None) -> str | None:
    """The HF name of a GGUF tensor name in a file of `arch` (None: a tensor the engine does not read)."""
    if gguf_name in _MODEL_NAMES:
        return _MODEL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    names = {**_LAYER_NAMES, **_FUSED_NAMES} if arch == "phi3" else _LAYER_NAMES
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    return None


def quantized_types(path: str | Path) -> set[str]:
    """The block formats the model's tensors are stored in (none for floats, or a directory of safetensors)."""
    if not is_gguf(path):
        return set()
    file = read_gguf(path)
    arch = _field(file, "general.architecture")
    kinds = {type_name(info.type_id) for name, info in file.tensors.items() if hf_name(name, arch) is not None}
    return kinds - set(FLOAT_TYPES)


def column_units(path: str | Path) -> tuple[int, int]:
    """The values a TP split must keep together in each row of o_proj and of down_proj (the projections
    it cuts along their rows): the largest block of the formats they are stored in, 1 for floats."""
    if not is_gguf(path):
        return 1, 1
    roles = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
    units = dict.fromkeys(roles, 1)
    for name, info in read_gguf(path).tensors.items():
        kind = type_name(info.type_id)
        for role in roles:
            if (hf_name(name) or "").endswith(role) and kind in FORMATS:
                units[role] = max(units[role], FORMATS[kind].block_values)
    return units[roles[0]], units[roles[1]]


def load_gguf_weights(path: str | Path, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The GGUF file's tensors under HF's names (see the module docstring), shapes checked first."""
    path = Path(path)
    arch = _field(read_gguf(path), "general.architecture")
    tensors = {name: t for t in read_tensors(path) if (name := hf_name(t.name, arch)) is not None}
    check_shapes(path, {name: t.shape for name, t in tensors.items()}, cfg)
    permuted = arch in PERMUTED_QK
    weights = {}
    for name, t in tensors.items():
        data = t.data.to(dtype) if t.fmt is None else t.data.view(t.shape[0], -1, t.fmt.block_bytes)
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = _unpermute(data, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
        weights[name] = data
    return unfused(weights, cfg)


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's row order of a q or k projection from llama.cpp's: within each head, its converter put the
    rows of the rotary's first half and second half alternately; whole rows move (a copy)."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def gguf_tokenizer_dir(path: str | Path, cache_root: Path) -> Path:
    """A directory holding the GGUF file's tokenizer: the file's own directory where a tokenizer.json lies
    next to it, else one written from its metadata once under cache_root, keyed by the file's size and
    mtime and name: a byte-level BPE vocabulary by gguf_tokenizer.py, another (sentencepiece) by
    transformers' GGUF converter, a one-time conversion like `phaseflip convert`."""
    path = Path(path)
    if (path.parent / "tokenizer.json").is_file():
        return path.parent
    stat = path.stat()
    key = hashlib.sha256(json.dumps([str(path.resolve()), stat.st_size, stat.st_mtime_ns]).encode()).hexdigest()[:16]
    target = cache_root / "gguf-tokenizers" / key
    if (target / "tokenizer.json").is_file():
        return target
    _extract_tokenizer(path, target)
    return target


def _extract_tokenizer(path: Path, target: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja of the GGUF file into target."""
    file = read_gguf(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=target.parent))
    try:
        if gguf_tokenizer.reads_vocabulary(file):
            gguf_tokenizer.write_tokenizer(file, staging)
        else:
            _convert_tokenizer(path, file, staging)
        os.rename(staging, target)
    except OSError:   # another process extracted it first
        if not (target / "tokenizer.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _convert_tokenizer(path: Path, file, out_dir: Path) -> None:
    """A vocabulary gguf_tokenizer.py does not build (sentencepiece, a split it does not know), written by
    transformers' GGUF converter."""
    try:
        import transformers
    except ImportError as e:
        raise CheckpointError(f"{path}: its {_field(file, 'tokenizer.ggml.model')!r} tokenizer (split "
                              f"{_field(file, 'tokenizer.ggml.pre')!r}) is read from the GGUF metadata by "
                              f"transformers, which is not installed ({e}); put the model's tokenizer.json next "
                              "to the file, or pip install transformers gguf") from e
    from phaseflip.engine.checkpoint.gguf_convert import save_tokenizer
    max_length = _field(file, f"{_field(file, 'general.architecture')}.context_length")
    save_tokenizer(transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), max_length, out_dir)
