"""The GPU check's quantized_decode section: GGUF block formats served on the device by the Triton kernels.

Owns: `quantized_decode`: the Llama-3.2-1B shape written as two GGUF files of random blocks (the
check's machine has no `gguf` package: the engine's own writer, engine/checkpoint/gguf_file.py), Q8_0
throughout and a Q4_K_M make-up (q, k, o, gate, up Q4_K; v and down Q6_K in every other layer and Q4_K
in the rest; the tied embedding Q6_K), each booted in the TP layout alone: batch-1 decode tokens/s
against the read bound of its quantized bytes (the engine's weight report over the device bandwidth of
section bandwidth) and against the bf16 engine of section decode_throughput. Random blocks: the values
are noise, the bytes a token reads are a real file's. The dry run writes a 256-wide stand-in (a K block
is 256 values) and serves it on the CPU.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from phaseflip.tools.gpu_context import Context

# GGML type ids
Q8_0, Q4_K, Q6_K, F32 = 8, 12, 14, 0
DRY_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=384, max_position_embeddings=512,
                 rms_norm_eps=1e-5, rope_theta=500000.0)
MAKE_UPS = ("Q8_0", "Q4_K_M")


def _types(make_up: str, name: str, layer: int) -> int:
    """The GGML type of a 2-D tensor in the make-up (`name` its role, `layer` its layer or -1)."""
    if make_up == "Q8_0":
        return Q8_0
    if name == "embed":
        return Q6_K
    return Q6_K if name in ("v", "down") and layer % 2 == 0 else Q4_K


def write_gguf_model(out_dir: Path, shape: dict, make_up: str, device: str, seed: int = 0) -> Path:
    """A llama GGUF of `shape` in `make_up`, random blocks drawn on `device`, the test tokenizer beside it."""
    import torch

    from phaseflip.engine.checkpoint.gguf_file import write_gguf
    from phaseflip.kernels.reference.quant import random_blocks
    from tests.models import make_tokenizer
    make_tokenizer(out_dir)
    c, arch = shape, "llama"
    h, q, kv, inter = (c["hidden_size"], c["num_attention_heads"] * c["head_dim"],
                       c["num_key_value_heads"] * c["head_dim"], c["intermediate_size"])
    meta = {"general.architecture": arch, f"{arch}.context_length": c["max_position_embeddings"],
            f"{arch}.embedding_length": h, f"{arch}.block_count": c["num_hidden_layers"],
            f"{arch}.feed_forward_length": inter, f"{arch}.attention.head_count": c["num_attention_heads"],
            f"{arch}.attention.head_count_kv": c["num_key_value_heads"], f"{arch}.attention.key_length": c["head_dim"],
            f"{arch}.attention.value_length": c["head_dim"],
            f"{arch}.attention.layer_norm_rms_epsilon": c["rms_norm_eps"], f"{arch}.rope.freq_base": c["rope_theta"]}
    tensors, counter = {}, iter(range(10 ** 6))

    def add(name: str, role: str, layer: int, rows: int, cols: int) -> None:
        kind = _types(make_up, role, layer)
        blocks = random_blocks(kind, rows, cols, seed=seed + next(counter), device=device)
        tensors[name] = (kind, (rows, cols), blocks.cpu().numpy().tobytes())

    def norm(name: str) -> None:
        tensors[name] = (F32, (h,), (torch.rand(h) * 0.4 + 0.8).numpy().tobytes())

    add("token_embd.weight", "embed", -1, c["vocab_size"], h)
    norm("output_norm.weight")
    for i in range(c["num_hidden_layers"]):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        norm(p + "ffn_norm.weight")
        for role, name, rows, cols in (("q", "attn_q", q, h), ("k", "attn_k", kv, h), ("v", "attn_v", kv, h),
                                       ("o", "attn_output", h, q), ("gate", "ffn_gate", inter, h),
                                       ("up", "ffn_up", inter, h), ("down", "ffn_down", h, inter)):
            add(f"{p}{name}.weight", role, i, rows, cols)
    path = out_dir / f"model-{make_up}.gguf"
    write_gguf(path, meta, tensors)
    return path


def quantized_decode(ctx: Context) -> dict:
    from phaseflip import LLM
    from phaseflip.tools.gpu_sections_engine import decode_rates, engine_kwargs
    p = ctx.profile
    if "llm" in ctx.shared:
        ctx.shared.pop("llm").shutdown()   # the device for these engines alone
    shape = DRY_SHAPE if ctx.dry_run else p.model
    bw, bf16 = ctx.shared.get("device_bw"), ctx.shared.get("ours", {}).get(1)
    rows = []
    for make_up in MAKE_UPS:
        out = ctx.work / f"quantized-{make_up}"
        out.mkdir(parents=True, exist_ok=True)
        try:
            t0 = time.perf_counter()
            path = write_gguf_model(out, shape, make_up, p.device)
            write_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            with LLM(**engine_kwargs(p, path, layouts=("tp",), park="never", compile=ctx.engine_compile,
                                     decode_buckets=(1,))) as llm:
                boot_s = time.perf_counter() - t0
                tok_s = decode_rates(llm, (1,), p.prompt_len, p.bench_tokens)[1]
                report = llm.inspect()["ranks"][0]["weights"]
                fallbacks = llm.stats()["eager_fallbacks"]
        finally:
            shutil.rmtree(out, ignore_errors=True)
        weights = report["tp" if "tp" in report else next(iter(report))]
        nbytes = weights["bytes_read_per_token"]
        bound = None if bw is None else bw / nbytes
        rows.append({"make_up": make_up, "bytes_by_storage": weights["bytes_by_storage"], "bytes_read_per_token": nbytes,
                     "write_s": write_s, "boot_s": boot_s, "tokens_per_s_batch_1": tok_s,
                     "bandwidth_bound_tokens_per_s": bound, "fraction_of_bound": None if bound is None else tok_s / bound,
                     "against_bf16_batch_1": None if bf16 is None else tok_s / bf16, "eager_fallbacks": fallbacks})
    return {"ok": True, "shape": "dry-run stand-in" if ctx.dry_run else "llama-1b", "device_bw_gb_s":
            None if bw is None else bw / 1e9, "bf16_tokens_per_s_batch_1": bf16, "rows": rows,
            "bound_rule": "device bandwidth / the quantized bytes a decode token reads (KV reads ignored)"}
