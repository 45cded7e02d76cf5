"""GGUF files for the test suite: a tiny HF llama written as llama.cpp writes one, each tensor in the
format a plan names, and the HF checkpoint of what those blocks decode to (gguf's own decoder), the
reference the engine's run on the file is held to.

Owns: `quantize_blocks` (gguf's quantizer where it writes the format; Q4_K and Q6_K, which gguf's Python
cannot write, by a plain absmax/min-max rounding of our own packed in GGML's layout: valid blocks, not
llama.cpp's optimised choice of scales), `write_llama_gguf` and `dequantized_reference`.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _fp16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(*v.shape, 2)


def _q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K blocks of w [n, k]: per 16 values an int8 scale of the block's fp16 d, q - 32 in [-32, 31]."""
    b = w.reshape(-1, 16, 16)
    scale = np.abs(b).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(np.divide(scale, d[:, None], out=np.zeros_like(scale), where=d[:, None] > 0)),
                 -128, 127).astype(np.int8)
    eff = d[:, None] * sc
    q = np.clip(np.round(np.divide(b, eff[..., None], out=np.zeros_like(b), where=eff[..., None] > 0)) + 32,
                0, 63).astype(np.uint8).reshape(-1, 2, 4, 32)   # [block, half, quarter, value]
    ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                         (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=2).reshape(-1, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6))
    blocks = np.concatenate([ql, qh.reshape(-1, 64), sc.view(np.uint8), _fp16_bytes(d)], axis=1)
    return blocks.reshape(w.shape[0], -1)


def _q4_k(w: np.ndarray) -> np.ndarray:
    """Q4_K blocks of w [n, k]: per 32 values a 6-bit scale and min of the block's fp16 d and dmin."""
    b = w.reshape(-1, 8, 32)
    low, high = np.minimum(b.min(-1), 0), b.max(-1)
    scale, mn = (high - low) / 15, -low
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (mn.max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(np.divide(scale, d[:, None], out=np.zeros_like(scale), where=d[:, None] > 0)), 0, 63)
    m = np.clip(np.round(np.divide(mn, dmin[:, None], out=np.zeros_like(mn), where=dmin[:, None] > 0)), 0, 63)
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    eff, off = d[:, None] * sc, dmin[:, None] * m
    q = np.clip(np.round(np.divide(b + off[..., None], eff[..., None], out=np.zeros_like(b),
                                   where=eff[..., None] > 0)), 0, 15).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)], axis=1)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)   # bytes 32i.. hold sub-blocks 2i (low), 2i + 1
    blocks = np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), scales, qs], axis=1)
    return blocks.reshape(w.shape[0], -1)


def quantize_blocks(w: np.ndarray, kind: str) -> np.ndarray:
    """w [n, k] float32 as `kind`'s blocks, uint8 [n, bytes a row] (F32: w itself)."""
    from gguf import GGMLQuantizationType, quants
    if kind == "F32":
        return w.astype(np.float32)
    if kind in ("Q4_K", "Q6_K"):
        return (_q4_k if kind == "Q4_K" else _q6_k)(np.ascontiguousarray(w, np.float32))
    return quants.quantize(np.ascontiguousarray(w, np.float32), GGMLQuantizationType[kind])


def dequantize_blocks(blocks: np.ndarray, kind: str) -> np.ndarray:
    """gguf's own decoding of `kind`'s blocks (F32: as they are)."""
    from gguf import GGMLQuantizationType, quants
    return blocks if kind == "F32" else quants.dequantize(blocks, GGMLQuantizationType[kind])


_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
         "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}   # the last two: Phi-3's fused


def gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF:
        return _GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest.removesuffix('.weight')]}.weight"


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order of a q or k projection (the rotary's halves interleaved)."""
    n = rows.shape[0]
    return rows.reshape(heads, 2, n // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def llama3_rope_freqs(cfg: dict) -> np.ndarray:
    """llama.cpp's rope_freqs for a llama3-scaled config: each rotary frequency's divisor (its converter's
    formula, public)."""
    import math
    p = cfg["rope_parameters"]
    dim, base, old = cfg["head_dim"], p["rope_theta"], p["original_max_position_embeddings"]
    low, high = old / p["low_freq_factor"], old / p["high_freq_factor"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi / (1.0 / (base ** (i / dim)))
        if wavelen < high:
            out.append(1.0)
        elif wavelen > low:
            out.append(p["factor"])
        else:
            smooth = (old / wavelen - p["low_freq_factor"]) / (p["high_freq_factor"] - p["low_freq_factor"])
            out.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def write_llama_gguf(model_dir: Path, out: Path, kinds: dict[str, str], arch: str = "llama") -> dict[str, np.ndarray]:
    """The HF checkpoint at model_dir (a llama, or `arch` "phi3") written as a GGUF file `out` (its tokenizer
    files beside it), each tensor in kinds[hf name] (F32 where unnamed). Returns each tensor's values as
    its blocks decode (gguf's decoder), under HF names and in HF's row order."""
    import json

    from gguf import GGMLQuantizationType, GGUFWriter
    from safetensors.numpy import load_file
    cfg = json.loads((model_dir / "config.json").read_text())
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    writer = GGUFWriter(str(out), arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    if cfg.get("rope_parameters", {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg))
    decoded = {}
    for name, values in tensors.items():
        kind = kinds.get(name, "F32")
        blocks = quantize_blocks(values, kind) if values.ndim == 2 else values.astype(np.float32)
        decoded[name] = dequantize_blocks(blocks, kind) if values.ndim == 2 else values
        heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
        for part, count in heads.items():
            if f"self_attn.{part}." in name:
                blocks = _permute(blocks, count)
        writer.add_tensor(gguf_name(name), blocks,
                          raw_dtype=None if kind == "F32" else GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for f in TOKENIZER_FILES:
        shutil.copy(model_dir / f, out.parent / f)
    return decoded


def dequantized_reference(model_dir: Path, decoded: dict[str, np.ndarray], out_dir: Path) -> Path:
    """An HF checkpoint (model_dir's config and tokenizer) holding `decoded`'s values: what the file's
    blocks decode to, for transformers to run."""
    from safetensors.numpy import save_file
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", *TOKENIZER_FILES):
        shutil.copy(model_dir / f, out_dir / f)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in decoded.items()},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
