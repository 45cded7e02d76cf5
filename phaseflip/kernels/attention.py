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
Tokens of padding sequences (and tokens past query_start_loc[-1]) produce zeros.

On CUDA tensors the op runs the Triton kernels (kernels/triton_kv_store.py, kernels/triton_attention.py:
no host sync, so it can be captured); on the CPU the batched path of kernels/cpu_attention.py. Compiled
CPU steps call phaseflip_cpu::paged_attention instead (kernels/cpu_decode.cpp, same schema): decodes
and prompt chunks stay in C++ (cpu_prefill.cpp: the chunks), a step it declines comes back to this op. The torch reference below, written plainly,
is the oracle all are tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from phaseflip.kernels import cpu_kernels
from phaseflip.kernels.cpu_attention import paged_attention_cpu
from phaseflip.kernels.dispatch import triton_available
from phaseflip.kernels.op_registry import define_op


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    # k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D], any block stride
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    block, offset = slots // k_cache.shape[1], slots % k_cache.shape[1]
    k_cache.index_put_((block, offset), k[valid])
    v_cache.index_put_((block, offset), v[valid])


def _gather_context(cache, block_table, length):
    # cache: [NB, BS, Hkv, D]; block_table: [..., B] -> [..., Hkv, length, D]
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    ctx = cache[block_table[..., :num_blocks]]                  # [..., nb, BS, Hkv, D]
    ctx = ctx.flatten(-4, -3)[..., :length, :, :]              # [..., L, Hkv, D]
    return ctx.transpose(-3, -2)                               # [..., Hkv, L, D]


def _decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale):
    # q: [n, Hq, D], one query per sequence, attending its whole context. Written out with einsum:
    # on the CPU, SDPA with enable_gqa is ~50x slower than this for one query row.
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    max_len = int(seq_lens.max())
    k = _gather_context(k_cache, block_tables, max_len)        # [n, Hkv, L, D]
    v = _gather_context(v_cache, block_tables, max_len)
    mask = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None]  # [n, L]
    s = torch.einsum("nhgd,nhld->nhgl", q.view(n, hkv, hq // hkv, d), k) * scale
    p = s.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(-1)
    return torch.einsum("nhgl,nhld->nhgd", p, v).reshape(n, hq, d)


def _expand_kv(x, group):
    # [1, Hkv, L, D] -> [1, Hq, L, D]; SDPA's own enable_gqa path is slow on the CPU.
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _prefill_attention(q, k, v, k_cache, v_cache, block_table, seq_len, scale):
    # q: [n, Hq, D] are the last n positions of a context of seq_len tokens (causal).
    n = q.shape[0]
    group = q.shape[1] // k.shape[1]
    start = seq_len - n
    qh = q.transpose(0, 1)[None]                               # [1, Hq, n, D]
    if start == 0:  # no cached prefix: this chunk's own K/V are the whole context
        kc, vc = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        mask = None
    else:
        kc = _gather_context(k_cache, block_table, seq_len)[None]  # [1, Hkv, L, D]
        vc = _gather_context(v_cache, block_table, seq_len)[None]
        pos = torch.arange(seq_len, device=q.device)
        mask = pos[None, :] <= (start + pos[:n])[:, None]          # [n, L]
    out = F.scaled_dot_product_attention(qh, _expand_kv(kc, group), _expand_kv(vc, group),
                                         attn_mask=mask, is_causal=mask is None, scale=scale)
    return out[0].transpose(0, 1)                              # [n, Hq, D]


def paged_attention_ref(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                        query_start_loc, scale: float):
    """The torch reference; see the module docstring for the metadata. Returns [T, Hq, D]."""
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode_rows = [i for i in range(len(lens)) if lens[i] > 0 and starts[i + 1] - starts[i] == 1]
    if decode_rows:
        rows = torch.tensor(decode_rows, device=q.device)
        tok = query_start_loc[rows]
        out[tok] = _decode_attention(q[tok], k_cache, v_cache, block_tables[rows], seq_lens[rows], scale)
    for i, seq_len in enumerate(lens):
        a, b = starts[i], starts[i + 1]
        if seq_len == 0 or b - a <= 1:
            continue
        out[a:b] = _prefill_attention(q[a:b], k[a:b], v[a:b], k_cache, v_cache, block_tables[i],
                                      seq_len, scale)
    return out


def paged_attention_impl(q, k, v, kv_cache, layer: int, slot_mapping, block_tables, seq_lens, query_start_loc,
                         scale: float) -> torch.Tensor:
    """The body of the op: the Triton kernels on CUDA, kernels/cpu_attention.py elsewhere."""
    if not q.is_cuda:
        return paged_attention_cpu(q, k, v, kv_cache[:, layer], slot_mapping, block_tables, seq_lens,
                                   query_start_loc, scale)
    k_cache, v_cache = kv_cache[:, layer, 0], kv_cache[:, layer, 1]
    if triton_available():
        from phaseflip.kernels.triton_attention import store_and_attend
        return store_and_attend(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                                query_start_loc, scale)
    # no triton: the reference (eager only; it synchronises with the host)
    return paged_attention_ref(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                               query_start_loc, scale)


def attend(q, k, v, kv_cache, layer: int, slot_mapping, block_tables, seq_lens, query_start_loc,
           scale: float) -> torch.Tensor:
    """What the model calls: the custom op while torch.compile traces (it must stay one opaque call:
    on the CPU, where the C++ kernels are built, their op, which runs a decode step without Python and
    hands any other step to this one), the body directly otherwise (the op's Python dispatch costs tens
    of microseconds per layer)."""
    if not torch.compiler.is_compiling():
        fn = paged_attention_impl
    else:
        fn = (cpu_kernels.paged_attention_op() if not q.is_cuda else None) or torch.ops.phaseflip.paged_attention
    return fn(q, k, v, kv_cache, layer, slot_mapping, block_tables, seq_lens, query_start_loc, scale)


# The op takes a layout's WHOLE KV view ([blocks, layers, 2, block_size, heads, D], layouts/kvcache.py)
# and a layer index, not the layer's K/V sub-views: inductor hands a custom op that mutates an offset
# sub-view of a closed-over tensor a fresh buffer instead of the cache (torch 2.13), so the compiled
# step would attend over zeros. A view of the whole region starting at offset 0 is passed intact.
def _paged_attention_fake(q, k, v, kv_cache, layer, slot_mapping, block_tables, seq_lens, query_start_loc,
                          scale):
    return torch.empty_like(q)


paged_attention = define_op(
    "paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, SymInt layer, Tensor slot_mapping, "
    "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale) -> Tensor",
    paged_attention_impl, _paged_attention_fake)
