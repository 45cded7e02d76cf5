"""Paged attention with the KV store, as one torch.library custom op (torch reference inside).

Owns: `phaseflip::paged_attention`, which writes this step's K/V into the paged cache at
`slot_mapping` and attends every query token over its sequence's cached context. It MUTATES the
caches in place (declared via mutates_args) so torch.compile treats the cache as opaque and never
copies or functionalises it.

Batch metadata (all int64, static shapes so a captured step can be replayed):
  slot_mapping    [T]      flat cache slot of each token; -1 = padding, written nowhere
  block_tables    [S, B]   block ids of each sequence (unused entries: any valid id, e.g. 0)
  seq_lens        [S]      context length of each sequence after this step; 0 = padding sequence
  query_start_loc [S + 1]  token offsets of each sequence's queries in the flattened batch
Tokens of padding sequences (and tokens past query_start_loc[-1]) produce zeros. With a sliding window W
(window > 0) a query at position p attends the keys p - W < j <= p only (transformers' sliding mask); with
softcap > 0 each scaled score s is taken as softcap * tanh(s / softcap) before the softmax (Gemma 2).

On CUDA tensors the op runs the Triton kernels (kernels/triton/kv_store.py, kernels/triton/attention.py:
no host sync, so it can be captured); on the CPU the C++ kernels' phaseflip::cpu_paged_attention
(kernels/cpu/decode.cpp and prefill.cpp, the same schema), which compiled CPU steps call directly. Where
neither is there (no triton, no C++ compiler, float16 on the CPU) the torch reference
(kernels/reference/attention.py) runs: written plainly, it is the oracle all are tested against.
"""
from __future__ import annotations

import torch

from phaseflip.kernels.cpu import library
from phaseflip.kernels.dispatch import triton_available
from phaseflip.kernels.op_registry import define_op
from phaseflip.kernels.reference.attention import paged_attention_ref


def paged_attention_impl(q, k, v, kv_cache, layer: int, slot_mapping, block_tables, seq_lens, query_start_loc,
                         scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """The body of the op: the Triton kernels on CUDA, the C++ kernels on the CPU, else the reference."""
    cpp = library.paged_attention_op(q.dtype) if not q.is_cuda else None
    if cpp is not None:
        return cpp(q, k, v, kv_cache, layer, slot_mapping, block_tables, seq_lens, query_start_loc, scale, window,
                   softcap)
    k_cache, v_cache = kv_cache[:, layer, 0], kv_cache[:, layer, 1]
    if q.is_cuda and triton_available():
        from phaseflip.kernels.triton.attention import store_and_attend
        return store_and_attend(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                                query_start_loc, scale, window, softcap)
    # the reference (eager only; it synchronises with the host)
    return paged_attention_ref(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                               query_start_loc, scale, window, softcap)


# The step's batch metadata (the docstring above), in the order the op takes it.
BATCH_FIELDS = ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")


def attend(q, k, v, kv_cache, layer: int, batch: dict[str, torch.Tensor], scale: float,
           window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """What the model calls, with the step's metadata as one mapping (BATCH_FIELDS): the custom op while
    torch.compile traces (it must stay one opaque call: on the CPU the C++ kernels' op, which runs every
    step without Python), the body directly otherwise (the op's Python dispatch costs tens of
    microseconds per layer). window: a sliding window's length (0: none); softcap: Gemma 2's score cap (0: none)."""
    fn = compiled_op(q) if torch.compiler.is_compiling() else paged_attention_impl
    return fn(q, k, v, kv_cache, layer, *[batch[name] for name in BATCH_FIELDS], scale, window, softcap)


def compiled_op(q: torch.Tensor):
    """The op a compiled step calls for q's attention: the C++ kernels' on the CPU where they are built
    for its dtype, else phaseflip::paged_attention."""
    cpp = library.paged_attention_op(q.dtype) if not q.is_cuda else None
    return cpp or torch.ops.phaseflip.paged_attention


# The op takes a layout's WHOLE KV view ([blocks, layers, 2, block_size, heads, D], rank/kvcache.py)
# and a layer index, not the layer's K/V sub-views: inductor hands a custom op that mutates an offset
# sub-view of a closed-over tensor a fresh buffer instead of the cache (torch 2.13), so the compiled
# step would attend over zeros. A view of the whole region starting at offset 0 is passed intact.
def _paged_attention_fake(q, k, v, kv_cache, layer, slot_mapping, block_tables, seq_lens, query_start_loc,
                          scale, window=0, softcap=0.0):
    return torch.empty_like(q)


paged_attention = define_op(
    "paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, SymInt layer, Tensor slot_mapping, "
    "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, int window=0, "
    "float softcap=0.0) -> Tensor",
    paged_attention_impl, _paged_attention_fake)
