"""The torch reference of paged attention with the KV store: written plainly, the oracle the C++ and
Triton kernels are tested against, and the CUDA body where triton is missing (eager only: it synchronises
with the host).

Owns: `store_kv` (this step's K/V into the paged cache at slot_mapping) and `paged_attention_ref` (store,
then every query token over its sequence's cached context, or with a sliding window W over its last W
positions: keys p - W < j <= p, transformers' sliding mask; scores soft-capped where softcap > 0, as Gemma 2
does). The metadata is kernels/attention.py's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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


def _capped(s: torch.Tensor, softcap: float) -> torch.Tensor:
    return softcap * torch.tanh(s / softcap) if softcap else s


def _decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, window: int = 0, softcap: float = 0.0):
    # q: [n, Hq, D], one query per sequence, attending its whole context. Written out with einsum:
    # on the CPU, SDPA with enable_gqa is ~50x slower than this for one query row.
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    max_len = int(seq_lens.max())
    k = _gather_context(k_cache, block_tables, max_len)        # [n, Hkv, L, D]
    v = _gather_context(v_cache, block_tables, max_len)
    pos = torch.arange(max_len, device=q.device)[None, :]
    mask = pos < seq_lens[:, None]                                               # [n, L]
    if window:
        mask &= pos >= seq_lens[:, None] - window
    s = _capped(torch.einsum("nhgd,nhld->nhgl", q.view(n, hkv, hq // hkv, d), k) * scale, softcap)
    p = s.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(-1)
    return torch.einsum("nhgl,nhld->nhgd", p, v).reshape(n, hq, d)


def _expand_kv(x, group):
    # [1, Hkv, L, D] -> [1, Hq, L, D]; SDPA's own enable_gqa path is slow on the CPU.
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _prefill_attention(q, k, v, k_cache, v_cache, block_table, seq_len, scale, window: int = 0,
                       softcap: float = 0.0):
    # q: [n, Hq, D] are the last n positions of a context of seq_len tokens (causal).
    n = q.shape[0]
    group = q.shape[1] // k.shape[1]
    start = seq_len - n
    qh = q.transpose(0, 1)[None]                               # [1, Hq, n, D]
    if start == 0 and not window:  # no cached prefix: this chunk's own K/V are the whole context
        kc, vc = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        mask = None
    else:
        kc = _gather_context(k_cache, block_table, seq_len)[None]  # [1, Hkv, L, D]
        vc = _gather_context(v_cache, block_table, seq_len)[None]
        pos = torch.arange(seq_len, device=q.device)
        q_pos = (start + pos[:n])[:, None]
        mask = pos[None, :] <= q_pos                               # [n, L]
        if window:
            mask &= pos[None, :] > q_pos - window
    if softcap:   # SDPA has no cap: the scores written out
        s = _capped(qh @ _expand_kv(kc, group).transpose(-1, -2) * scale, softcap)
        if mask is None:
            mask = torch.ones(n, kc.shape[-2], dtype=torch.bool, device=q.device).tril()
        out = s.masked_fill(~mask, float("-inf")).softmax(-1) @ _expand_kv(vc, group)
    else:
        out = F.scaled_dot_product_attention(qh, _expand_kv(kc, group), _expand_kv(vc, group),
                                             attn_mask=mask, is_causal=mask is None, scale=scale)
    return out[0].transpose(0, 1)                              # [n, Hq, D]


def paged_attention_ref(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                        query_start_loc, scale: float, window: int = 0, softcap: float = 0.0):
    """The torch reference; see the module docstring for the metadata, window and softcap (0: none).
    Returns [T, Hq, D]."""
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode_rows = [i for i in range(len(lens)) if lens[i] > 0 and starts[i + 1] - starts[i] == 1]
    if decode_rows:
        rows = torch.tensor(decode_rows, device=q.device)
        tok = query_start_loc[rows]
        out[tok] = _decode_attention(q[tok], k_cache, v_cache, block_tables[rows], seq_lens[rows], scale, window,
                                     softcap)
    for i, seq_len in enumerate(lens):
        a, b = starts[i], starts[i + 1]
        if seq_len == 0 or b - a <= 1:
            continue
        out[a:b] = _prefill_attention(q[a:b], k[a:b], v[a:b], k_cache, v_cache, block_tables[i],
                                      seq_len, scale, window, softcap)
    return out
