"""Paged attention with the KV store on the CPU: one set of index gathers per step, batched matmuls.

Owns: `paged_attention_cpu`, the body `phaseflip::paged_attention` runs on CPU tensors. Its contract
is kernels/attention.py's (that module's `paged_attention_ref` stays the simple oracle it is tested
against); what differs is how the work is laid out:

- Every layer of a step sees the same metadata, so the index arithmetic (which tokens are stored where,
  which rows are decodes, which cache rows each decode reads, its padding mask) is done ONCE per step
  in an `AttentionGathers` and reused by all layers. The gathers are remembered by value: the metadata it was
  built from is kept and compared (torch.equal, a few microseconds), never trusted by identity, so a
  reused buffer with new contents gets new gathers. One `GathersCache` per process keeps it: the op takes
  tensors only, so no caller can hand it an owner.
- The layer's K and V caches are read and written as rows of D elements of one view: K of (block b,
  offset o, kv head h) is row b * rows_per_block + o * Hkv + h, its V block_size * Hkv rows further
  (the region is block-major, layouts/kvcache.py: a block holds each layer's K then V, and a layer's
  blocks lie a whole block apart). So one gather reads a context's K and V together, and one scatter
  stores a step's: per layer the attention runs a handful of ops, which matters because it runs on
  caches the layer's projections have just flushed.
- Decode rows gather their context straight into the layout attention wants ([rows, Hkv, L, D], one
  row of D per (sequence, kv head, position)), so each layer moves its KV once into place and runs one
  fused SDPA call for all rows (a kv head's query heads as its query block): no per-row Python, no GQA
  head expansion, no permute copies: one fused call per layer is cheaper than bmm + scale + softmax +
  bmm, each of which pays for caches the layer's projections have just flushed.
- Rows are grouped by context length (sorted, a new group when padding would exceed a quarter of the
  real work), so a short row does not pay for the longest one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from phaseflip.kernels.cpu import library

PAD_WASTE = 1.25      # a decode group's padded cells may exceed its real cells by this factor
MAX_GROUPS = 8


@dataclass(frozen=True)
class DecodeGroup:
    tokens: torch.Tensor          # [n] token index (in the flat batch) of each row
    gather: torch.Tensor          # [2 * n * Hkv * L] cache rows of K, then of V (module docstring)
    bias: torch.Tensor | None     # [n, 1, 1, L] 0 / -inf; None when no row is padded
    length: int                   # L, the group's longest context


@dataclass(frozen=True)
class PrefillRow:
    start: int                    # first token in the flat batch
    stop: int                     # one past the last
    seq_len: int                  # context length after this step
    gather: torch.Tensor | None   # [2 * Hkv * seq_len] context rows of K, then of V; None when the
                                  # chunk is its whole context
    bias: torch.Tensor | None     # [G * n, seq_len] 0 / -inf causal bias over the context (with gather)


@dataclass(frozen=True)
class AttentionGathers:
    key: tuple                    # the metadata (cloned) and cache geometry it was built from
    store_tokens: torch.Tensor | None  # tokens written to the cache (None: all of them)
    store_rows: torch.Tensor          # [2 * stored tokens * Hkv] the rows their K, then V, go to
    decode: tuple[DecodeGroup, ...]
    prefill: tuple[PrefillRow, ...]
    covers_all: bool              # one decode group holding tokens 0..T-1 in order: no scatter needed


def _same(key: tuple, meta: tuple) -> bool:
    return all(a.shape == b.shape and torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
               for a, b in zip(key, meta))


@dataclass(frozen=True)
class Geometry:
    block_size: int
    hkv: int
    rows_per_block: int           # the cache's block stride in rows of D

    def first_rows(self, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The K row of kv head 0 at (block, offset in the block)."""
        return blocks * self.rows_per_block + offsets * self.hkv

    def with_v(self, k_rows: torch.Tensor) -> torch.Tensor:
        """K rows, then the V rows beside them."""
        return torch.cat([k_rows, k_rows + self.block_size * self.hkv])


def _slots(block_row: torch.Tensor, length: int, geo: Geometry, pad_to: int) -> torch.Tensor:
    """Head-0 cache rows of positions 0..pad_to-1 of one sequence (positions >= length repeat the last)."""
    pos = torch.arange(pad_to).clamp_(max=length - 1)
    return geo.first_rows(block_row[pos // geo.block_size], pos % geo.block_size)


def _rows(slots: torch.Tensor, hkv: int) -> torch.Tensor:
    # head-0 rows [..., L] -> the rows of every kv head, ordered [..., Hkv, L]
    return (slots.unsqueeze(-2) + torch.arange(hkv)[:, None]).reshape(-1)


def _group(order: list[int], lens: list[int]) -> list[list[int]]:
    groups: list[list[int]] = []
    for i in order:  # ascending length
        g = groups[-1] if groups else None
        if g is not None and (len(groups) >= MAX_GROUPS or
                              (len(g) + 1) * lens[i] <= PAD_WASTE * (sum(lens[j] for j in g) + lens[i])):
            g.append(i)
        else:
            groups.append([i])
    return groups


def _decode_group(rows: list[int], starts, lens, block_tables, geo: Geometry) -> DecodeGroup:
    length = max(lens[i] for i in rows)
    slots = torch.stack([_slots(block_tables[i], lens[i], geo, length) for i in rows])
    bias = None
    if any(lens[i] < length for i in rows):
        real = torch.tensor([lens[i] for i in rows])
        bias = torch.zeros(len(rows), 1, 1, length)
        bias.masked_fill_((torch.arange(length)[None, :] >= real[:, None])[:, None, None, :], float("-inf"))
    return DecodeGroup(torch.tensor([starts[i] for i in rows]), geo.with_v(_rows(slots, geo.hkv)), bias, length)


def _prefill_row(start: int, stop: int, seq_len: int, block_row, geo: Geometry, group: int) -> PrefillRow:
    n = stop - start
    if n == seq_len:  # the chunk is its whole context: its own K/V, plain causal
        return PrefillRow(start, stop, seq_len, None, None)
    # queries of one kv head side by side ([Hkv, G * n, D]): the causal bias repeated per group
    pos = torch.arange(seq_len)
    hidden = pos[None, :] > (seq_len - n + torch.arange(n))[:, None]            # [n, seq_len]
    bias = torch.zeros(n, seq_len).masked_fill_(hidden, float("-inf")).repeat(group, 1)
    return PrefillRow(start, stop, seq_len, geo.with_v(_rows(_slots(block_row, seq_len, geo, seq_len), geo.hkv)),
                      bias)


def build_gathers(slot_mapping, block_tables, seq_lens, query_start_loc, block_size: int, hkv: int,
               group: int, rows_per_block: int | None = None) -> AttentionGathers:
    """rows_per_block: the block stride in rows of D (None: blocks of one layer's K and V, adjacent)."""
    geo = Geometry(block_size, hkv, 2 * block_size * hkv if rows_per_block is None else rows_per_block)
    key = (slot_mapping.clone(), block_tables.clone(), seq_lens.clone(), query_start_loc.clone(), block_size,
           hkv, group, geo.rows_per_block)
    valid = slot_mapping >= 0
    store_tokens = None if bool(valid.all()) else valid.nonzero().flatten()
    stored = slot_mapping if store_tokens is None else slot_mapping[store_tokens]
    store_rows = geo.with_v(_rows(geo.first_rows(stored // block_size, stored % block_size)[:, None], hkv))
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    decode = [i for i, n in enumerate(lens) if n > 0 and starts[i + 1] - starts[i] == 1]
    groups = tuple(_decode_group(g, starts, lens, block_tables, geo)
                   for g in _group(sorted(decode, key=lens.__getitem__), lens))
    prefill = tuple(_prefill_row(starts[i], starts[i + 1], n, block_tables[i], geo, group)
                    for i, n in enumerate(lens) if n > 0 and starts[i + 1] - starts[i] > 1)
    t = slot_mapping.shape[0]
    covers_all = (len(groups) == 1 and len(decode) == t
                  and torch.equal(groups[0].tokens, torch.arange(t)))
    return AttentionGathers(key, store_tokens, store_rows, groups, prefill, covers_all)


class GathersCache:
    """The last gathers built, reused while the metadata is unchanged (compared by value), else rebuilt."""

    def __init__(self):
        self.last: AttentionGathers | None = None

    def get(self, slot_mapping, block_tables, seq_lens, query_start_loc, block_size: int, hkv: int,
            group: int, rows_per_block: int) -> AttentionGathers:
        meta = (slot_mapping, block_tables, seq_lens, query_start_loc, block_size, hkv, group, rows_per_block)
        if self.last is None or not _same(self.last.key, meta):
            self.last = build_gathers(*meta)
        return self.last


_gathers = GathersCache()   # the process's one cache: the op passes tensors only, so no caller can own it


def _attend_decode(q, rows, g: DecodeGroup, scale: float) -> torch.Tensor:
    # q: [n, Hq, D]; rows: the layer's K and V as rows of D (_as_rows). The G query heads sharing a kv
    # head are one [G, D] query block against that head's [L, D] context: one fused SDPA call does the
    # scores, the softmax and the weighted sum (float accumulation for half types) for every row.
    n, hq, d = q.shape
    hkv = g.gather.numel() // (2 * n * g.length)
    kv = rows.index_select(0, g.gather).view(2, n, hkv, g.length, d)
    mask = None if g.bias is None else g.bias.to(q.dtype)            # [n, 1, 1, L]
    out = F.scaled_dot_product_attention(q.view(n, hkv, hq // hkv, d), kv[0], kv[1], attn_mask=mask,
                                         scale=scale)
    return out.view(n, hq, d)


def _attend_prefill(q, k, v, rows, row: PrefillRow, scale: float) -> torch.Tensor:
    # q, k, v: this chunk's [n, H, D]; the last n positions of a causal context of row.seq_len tokens
    n, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    if row.gather is None:  # the chunk is the whole context: its own K/V, plain causal, the kv heads
        # shared by their query heads inside SDPA (enable_gqa: faster than two repeat_interleave copies
        # before it)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True, scale=scale,
                                             enable_gqa=group > 1)
        return out[0].transpose(0, 1)
    kv = rows.index_select(0, row.gather).view(2, 1, hkv, row.seq_len, d)
    qg = q.transpose(0, 1).reshape(1, hkv, group * n, d)
    out = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=row.bias.to(q.dtype), scale=scale)
    return out.view(hq, n, d).transpose(0, 1)                   # [1, Hkv, G*n, D] -> [n, Hq, D]


def _as_rows(kv_layer: torch.Tensor) -> torch.Tensor:
    """A layer's [num_blocks, 2 (k, v), block_size, Hkv, D] caches, whose blocks may lie a stride apart,
    as rows of D over the same memory (rows between blocks belong to other layers, never indexed)."""
    nb, _, bs, hkv, d = kv_layer.shape
    if kv_layer.stride()[1:] != (bs * hkv * d, hkv * d, d, 1) or kv_layer.stride(0) % d:
        raise ValueError(f"KV strides {kv_layer.stride()} are not block-strided [blocks, 2, {bs}, {hkv}, {d}]")
    return kv_layer.as_strided(((nb - 1) * (kv_layer.stride(0) // d) + 2 * bs * hkv, d), (d, 1))


def paged_attention_cpu(q, k, v, kv_layer, slot_mapping, block_tables, seq_lens, query_start_loc,
                        scale: float) -> torch.Tensor:
    """Store this step's K/V, then attend; the contract of kernels/attention.py, with the layer's caches
    as one [num_blocks, 2, block_size, Hkv, D] view. Returns [T, Hq, D]. The C++ kernel takes the step
    where it is built (kernels/cpu/library.py), reading the cache in place: decodes, and prompt chunks
    at head sizes its tiles divide; it declines (an empty result) any other step, which runs here."""
    kernel = library.decode_attention_op() if q.dtype in library.DTYPES else None
    if kernel is not None:
        out = kernel(q, k, v, kv_layer, slot_mapping, block_tables, seq_lens, query_start_loc, scale)
        if out.numel():
            return out
    t, hkv, d = k.shape
    gathers = _gathers.get(slot_mapping, block_tables, seq_lens, query_start_loc, kv_layer.shape[2], hkv,
                      q.shape[1] // hkv, kv_layer.stride(0) // d)
    rows = _as_rows(kv_layer)
    new_k, new_v = k, v
    if gathers.store_tokens is not None:
        new_k, new_v = k.index_select(0, gathers.store_tokens), v.index_select(0, gathers.store_tokens)
    rows.index_copy_(0, gathers.store_rows, torch.cat([new_k.reshape(-1, d), new_v.reshape(-1, d)]))
    if gathers.covers_all:
        return _attend_decode(q, rows, gathers.decode[0], scale)
    out = torch.zeros_like(q)
    for g in gathers.decode:
        out.index_copy_(0, g.tokens, _attend_decode(q.index_select(0, g.tokens), rows, g, scale))
    for row in gathers.prefill:
        a, b = row.start, row.stop
        out[a:b] = _attend_prefill(q[a:b], k[a:b], v[a:b], rows, row, scale)
    return out
