"""The decoder layers of a decode step (one token each of up to MAX_ROWS sequences) as one C++ call on
the CPU (layer.cpp), and when a step takes it.

Owns: `serves` (whether forward's layers run as that call), `decoder_layers` (the call in forward.py's
terms) and `report` (what a boot says about it).

Why: a small decode step streams every weight once for all its tokens, so it should run at the memory's
read speed. As ~8 operators a layer, inductor's or eager ones, its threads meet at a join after each and
the main thread's dispatch runs alone between them, so the step falls well short of the speed its
products alone stream at. The fused call runs every layer in one parallel region with a barrier between
phases.

When: calls outside a trace (eager steps, and the eager forward around a compiled prefill's layers), one
token a sequence (T == S) for up to MAX_ROWS sequences, the whole layer on this rank (no tensor-parallel
partial sums to reduce between its phases), float32 or bfloat16, with projections of that dtype where the
boot measured the few-rows kernel the fastest one-row product (the fused products are its row dot), or in
GGUF blocks for one token (the fused products are the quantized kernel's one-row dot, qrow.h: the same
answer as forward's). compile="auto" does not compile the decode buckets of up to SURE_ROWS rows the
fused layers run, and measures those above against inductor's step (rank/compile_choice.py);
compile="on" runs inductor's steps, compile="off" this one.
"""
from __future__ import annotations

import torch

from phaseflip.kernels.cpu import library, linear

DTYPES = (torch.float32, torch.bfloat16)
MAX_ROWS = 8   # tokens a call takes (layer.cpp's dot::MAX_ROWS)
# rows up to which the fused layers ran faster than inductor's compiled step in every measurement
# (float32 and bfloat16, docs/performance.md): compile="auto" does not measure those buckets, and
# measures the buckets above, up to MAX_ROWS, like any other (rank/compile_choice.py)
SURE_ROWS = 4


def serves(residual: torch.Tensor, weight_dtype: torch.dtype, tp_size: int, kv_cache: torch.Tensor,
           block_tables: torch.Tensor, plain: bool = True) -> bool:
    """Whether forward's layers, their projections' weights of weight_dtype, run as one decode_layers call
    (see the module's "When"); plain: every layer has a dense MLP and full attention. As many tokens as
    sequences is one token each: an eager step's metadata is exact-size, every sequence with a token."""
    if residual.is_cuda or torch.compiler.is_compiling() or kv_cache.dim() != 6:
        return False
    if weight_dtype not in (residual.dtype, torch.uint8):   # uint8: GGUF blocks
        return False
    rows = residual.shape[0]
    return (rows == block_tables.shape[0] and rows <= max_rows(weight_dtype)
            and _why_not(weight_dtype, tp_size, plain) is None)


def max_rows(weight_dtype: torch.dtype) -> int:
    """The most tokens a call takes with projections of weight_dtype (GGUF blocks: one)."""
    return 1 if weight_dtype == torch.uint8 else MAX_ROWS


def decoder_layers(weights, eps: float, scale: float, residual: torch.Tensor, meta: dict[str, torch.Tensor],
                   kv_cache: torch.Tensor, cos_sin: torch.Tensor, final_norm: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """forward's loop of decoder_layer over `weights.layers` (a RankWeights) for one token a sequence: (the
    last MLP's output, the residual stream before it), each layer's K/V of the tokens stored at
    meta["slot_mapping"] (layer i of the list in layer i of kv_cache). With final_norm (the rank holds the
    head): (the final norm of the residual stream, that stream), forward's `_add_norm` after its last
    layer."""
    return library.decode_layers_op()(residual, *_weight_lists(weights), kv_cache, meta["slot_mapping"],
                                      meta["block_tables"], meta["seq_lens"], cos_sin, eps, scale, final_norm)


def _weight_lists(weights) -> tuple:
    """The op's weight arguments: one list per weight kind, qkv_proj and gate_up_proj as their parts (a
    Split's, rank/weights.py), and how many parts each layer has."""
    kinds = weights.across_layers
    qkv, qkv_parts = kinds["qkv_proj"]
    gate_up, gate_up_parts = kinds["gate_up_proj"]
    return (kinds["input_layernorm"][0], qkv, kinds["qkv_bias"][0], kinds["q_norm"][0], kinds["k_norm"][0],
            kinds["o_proj"][0], kinds["post_attention_layernorm"][0], gate_up, kinds["down_proj"][0], qkv_parts,
            gate_up_parts)


def report(dtype: torch.dtype, tp_size: int, plain: bool = True) -> dict:
    """Whether this rank's eager decode steps run the fused layers, up to how many rows, and why not where
    they do not."""
    reason = _why_not(dtype, tp_size, plain)
    return {"choice": "operators" if reason else "fused layers", "reason": reason,
            "rows": 0 if reason else max_rows(dtype)}


def _why_not(dtype: torch.dtype, tp_size: int, plain: bool = True) -> str | None:
    """Why one token's steps of this dtype on a rank of tp_size do not run fused (None: they do)."""
    if not plain:
        return "mixture-of-experts or sliding-window layers (the fused layers run dense MLPs, full attention)"
    if tp_size != 1:
        return f"layers split over {tp_size} ranks (partial sums reduced between phases)"
    if dtype not in DTYPES and dtype != torch.uint8:
        return f"{dtype} (float32 and bfloat16, or GGUF blocks, only)"
    if library.decode_layers_op() is None:
        return f"no kernels: {library.kernel_report()['reason']}"
    if dtype != torch.uint8 and linear.form(1, dtype) != "kernel":   # the fused products are the kernel's row dot
        return (f"one-row products take {linear.form(1, dtype)!r}, not the few-rows kernel (the boot's "
                "measurement; unmeasured: 'stationary')")
    return None
