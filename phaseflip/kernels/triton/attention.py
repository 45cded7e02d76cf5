"""Paged attention as Triton kernels: one varlen causal kernel for decode and chunked prefill, split
along the context when there are too few programs to fill the device, plus the reduce of the splits.

Owns: `paged_attention_triton` (each sequence's query tokens attend its paged context, causally, or
within a sliding window: a tile reads from its first row's window start; scores soft-capped on request), its
two named entry points `paged_decode_attention` (one query per sequence) and `paged_prefill_attention`
(chunks over a cached prefix), and `store_and_attend`, the CUDA body of `phaseflip::paged_attention`.
The torch reference and the metadata layout are in kernels/attention.py.

Capture-safe: no host synchronisation; every launch size comes from tensor SHAPES, never values, so a
CUDA graph captured for a bucket replays for any metadata that fits it. Never launched at import.

Tiling: a sequence's query tokens are cut into tiles of BLOCK_Q tokens; one program takes one tile x one
KV head (its G query heads: BLOCK_Q * G rows of a BLOCK_M-row block) x one context split. Tile t of
sequence i is program `query_start_loc[i] // BLOCK_Q + i + t`, so `T // BLOCK_Q + S` programs cover any
batch of T tokens and S sequences; a program finds its sequence by binary search. Scores live in the
log2 domain (exp2); a split writes its unnormalised (acc, max, sum) and `_reduce_splits` merges them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from phaseflip.kernels.triton.kv_store import store_kv_triton

LOG2E = 1.4426950408889634
MIN_SPLIT_KEYS = 256   # a context split shorter than this costs more in the reduce than it saves


@triton.jit
def _find_seq(qsl_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    # the last sequence i with query_start_loc[i] // BLOCK_Q + i <= tile (strictly increasing in i)
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, acc_ptr, m_ptr, l_ptr,
                      block_tables_ptr, seq_lens_ptr, qsl_ptr, qk_scale, window, softcap, num_seqs, num_splits,
                      num_q_heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks,
                      stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                      G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                      TILE_N: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
                      DOT_F32: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(qsl_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    if q_tile * BLOCK_Q >= q_len:   # past this sequence's tiles (or padding tokens)
        return
    if seq_len == 0:                # a padding sequence (an empty context would give zeros anyway)
        return

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_tile * BLOCK_Q + rows // G                      # query index within the sequence
    head = kv_head * G + rows % G
    row_ok = (rows < BLOCK_Q * G) & (q_tok < q_len)
    q_pos = seq_len - q_len + q_tok                           # absolute position: sees keys <= q_pos
    tok = q_start + q_tok                                     # row in the flattened batch
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)          # [BLOCK_M, BLOCK_D]

    # this tile's context is [0, its last query position]; split `split` takes one slice of it
    ctx_len = seq_len - q_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
    oldest = 0   # the oldest key a row of the tile may see: its first row's window start
    if window > 0:
        oldest = tl.maximum(seq_len - q_len + q_tile * BLOCK_Q - window + 1, 0)
    split_len = tl.cdiv(tl.cdiv(ctx_len - oldest, num_splits), TILE_N) * TILE_N
    start = (oldest + split * split_len).to(tl.int32)
    end = tl.minimum(start + split_len, ctx_len).to(tl.int32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, TILE_N)
    for j in range(start, end, TILE_N):
        pos = j + n
        pos_ok = pos < end
        blk = tl.load(block_tables_ptr + seq * stride_bt + pos // PAGE, mask=pos_ok, other=0)
        off = pos % PAGE
        k = tl.load(k_cache_ptr + blk[None, :] * stride_kb + off[None, :] * stride_ks + kv_head * stride_kh
                    + d[:, None], mask=pos_ok[None, :] & d_ok[:, None], other=0.0)   # [BLOCK_D, TILE_N]
        if DOT_F32:   # the interpreter multiplies bf16 as raw uint16 bits: give it float32
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision=PREC) * qk_scale
        else:
            s = tl.dot(q, k, input_precision=PREC) * qk_scale                       # [BLOCK_M, TILE_N]
        if softcap > 0:   # softcap * tanh(s / softcap) on the natural-log scores, tanh written with exp2
            x = s / (1.4426950408889634 * softcap)
            t = tl.exp2(-2.8853900817779268 * tl.abs(x))   # e^(-2|x|)
            s = tl.where(x < 0, -1.0, 1.0) * (1.0 - t) / (1.0 + t) * (softcap * 1.4426950408889634)
        seen = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if window > 0:
            seen = seen & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no NaN
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs + kv_head * stride_vh
                    + d[None, :], mask=pos_ok[:, None] & d_ok[None, :], other=0.0)   # [TILE_N, BLOCK_D]
        p = p.to(v.dtype)                                      # P in the cache dtype, as on the GPU
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision=PREC)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC)
        m_i = m_new

    if SPLIT:
        part = (tok * num_q_heads + head) * num_splits + split                     # [BLOCK_M]
        tl.store(m_ptr + part, m_i, mask=row_ok)
        tl.store(l_ptr + part, l_i, mask=row_ok)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _reduce_splits(out_ptr, acc_ptr, m_ptr, l_ptr, num_splits, stride_ot, stride_oh,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    # one program per (token, query head); splits never written keep m = -inf and weigh 0
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    part = (t.to(tl.int64) * tl.num_programs(1) + h) * num_splits + s
    m = tl.load(m_ptr + part, mask=s_ok, other=float("-inf"))
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))     # [BLOCK_S]
    used = s_ok & (w > 0)
    denom = tl.sum(tl.load(l_ptr + part, mask=used, other=0.0) * w, 0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=used[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8   # the interpreter: small, so that long test contexts get split
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_programs: int, max_context: int, num_sms: int) -> int:
    """Context splits from static sizes only: enough programs to fill the device twice, each split
    at least MIN_SPLIT_KEYS long, at most 16."""
    if num_programs >= num_sms:
        return 1
    return max(1, min(16, max_context // MIN_SPLIT_KEYS, -(-2 * num_sms // num_programs)))


def _block_q(num_tokens: int, num_seqs: int, group: int) -> int:
    # decode-shaped (a token per sequence): one token per tile; prefill: ~64 rows per tile
    return 1 if num_tokens <= num_seqs else max(1, 64 // group)


def paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale: float, *,
                           window: int = 0, softcap: float = 0.0, block_q: int | None = None,
                           num_splits: int | None = None, tile_n: int = 64, num_warps: int = 4) -> torch.Tensor:
    """q: [T, Hq, D]; caches: [num_blocks, page, Hkv, D] (last dim contiguous); metadata and window as in
    kernels/attention.py. Returns [T, Hq, D]; padding tokens and padding sequences give zeros."""
    num_tokens, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = hq // hkv
    assert hq == hkv * group and q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if num_tokens == 0 or num_seqs == 0:
        return torch.zeros_like(q)
    block_q = block_q or _block_q(num_tokens, num_seqs, group)
    block_m = max(16, triton.next_power_of_2(block_q * group))
    num_tiles = num_tokens // block_q + num_seqs
    if num_splits is None:
        num_splits = choose_num_splits(num_tiles * hkv, block_tables.shape[1] * page, _num_sms(q.device))
    split = num_splits > 1
    out = torch.empty_like(q) if split else torch.zeros_like(q)
    if split:   # partials in float32: m starts at -inf so splits never written weigh nothing
        m = torch.full((num_tokens, hq, num_splits), float("-inf"), dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        acc = torch.empty((num_tokens, hq, num_splits, d), dtype=torch.float32, device=q.device)
    else:
        m = l = acc = out   # unused
    block_d = max(16, triton.next_power_of_2(d))
    _attention_kernel[(num_tiles, hkv, num_splits)](
        q, k_cache, v_cache, out, acc, m, l, block_tables, seq_lens, query_start_loc, scale * LOG2E, window,
        float(softcap), num_seqs, num_splits, hq, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_tables.stride(0),
        G=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=d, BLOCK_D=block_d, PAGE=page,
        TILE_N=max(16, tile_n), SPLIT=split, PREC="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_F32=q.device.type != "cuda", num_warps=num_warps)
    if split:
        _reduce_splits[(num_tokens, hq)](out, acc, m, l, num_splits, out.stride(0), out.stride(1),
                                         HEAD_DIM=d, BLOCK_D=block_d,
                                         BLOCK_S=max(2, triton.next_power_of_2(num_splits)))
    return out


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale: float, *, window: int = 0,
                           softcap: float = 0.0, num_splits: int | None = None, tile_n: int = 64) -> torch.Tensor:
    """One query per sequence (q: [S, Hq, D], the last position of each context of seq_lens)."""
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int64, device=q.device)
    return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, qsl, scale, window=window,
                                  softcap=softcap, block_q=1, num_splits=num_splits, tile_n=tile_n)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale: float, *,
                            window: int = 0, softcap: float = 0.0, num_splits: int | None = None,
                            tile_n: int = 64) -> torch.Tensor:
    """Chunks of queries (varlen, query_start_loc) over a cached prefix: the chunk's K/V must already
    be in the cache (store_kv_triton first), since every key is read from the pages."""
    group = q.shape[1] // k_cache.shape[2]
    return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                  window=window, softcap=softcap, block_q=max(1, 64 // group), num_splits=num_splits,
                                  tile_n=tile_n)


def store_and_attend(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                     scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """The CUDA body of phaseflip::paged_attention: store this step's K/V, then attend."""
    store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                  window=window, softcap=softcap)
