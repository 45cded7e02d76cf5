"""Live-KV reshard between two layouts' views of the same region: read -> exchange -> write.

Owns: which slice of every live block each rank sends to each other rank, and the three legs.
Rank r holds (layers A_r) x (kv heads A_r) in the source layout and must end with (layers B_s) x
(kv heads B_s) in the target: r sends s the intersection, over one all_to_all. The legs move any set
of blocks, so the flip can move the live blocks a chunk at a time: the region is block-major
(rank/kvcache.py), so the two views alias each block's bytes with that block's own bytes only,
and once a chunk's blocks are read into the send buffer, writing them cannot clobber a block that is
still to be read. The send buffer of the chunk in flight is also what a rollback restores it from.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from phaseflip.rank.kvcache import KVView
from phaseflip.rank.shard import RankShard, Span


@dataclass(frozen=True)
class Piece:
    layers: Span   # global layer ids
    heads: Span    # global kv-head ids

    @property
    def empty(self) -> bool:
        return self.layers.count == 0 or self.heads.count == 0


def _intersect(a: Span, b: Span) -> Span:
    start = max(a.start, b.start)
    return Span(start, max(0, min(a.stop, b.stop) - start))


def piece(src: RankShard, dst: RankShard) -> Piece:
    return Piece(_intersect(src.layers, dst.layers), _intersect(src.kv_heads, dst.kv_heads))


def _local(view_owner: RankShard, p: Piece) -> tuple[slice, slice]:
    """p as local (layer, head) slices of the view held by view_owner."""
    l0 = p.layers.start - view_owner.layers.start
    h0 = p.heads.start - view_owner.kv_heads.start
    return slice(l0, l0 + p.layers.count), slice(h0, h0 + p.heads.count)


def _pieces(me: RankShard, others: tuple[RankShard, ...]):
    """(local layer slice, local head slice, piece) of my intersection with each other rank (None: empty)."""
    for other in others:
        p = piece(me, other)
        yield None if p.empty else (*_local(me, p), p)


def read(view: KVView, blocks: torch.Tensor, me_src: RankShard, dst_shards: tuple[RankShard, ...],
         out: torch.Tensor) -> None:
    """Copy, per destination rank, its slice of `blocks` straight into the flat send buffer `out`, in
    the order and sizes of `splits` (one copy: no clone, no concatenation). What it copies is every
    byte of those blocks this rank holds (the target shards cover all layers and heads), so it is also
    what a rollback restores them from."""
    n = blocks.numel()
    _, _, _, bs, _, d = view.tensor.shape
    if sum(splits(me_src, dst_shards, n, bs, d)) > out.numel():
        raise ValueError(f"send buffer of {out.numel()} elements is too small for {n} blocks")
    offset = 0
    for x in _pieces(me_src, dst_shards):
        if x is not None:
            ls, hs, p = x
            part = out[offset: offset + n * p.layers.count * 2 * bs * p.heads.count * d]
            torch.index_select(view.tensor[:, ls, :, :, hs, :], 0, blocks,
                               out=part.view(n, p.layers.count, 2, bs, p.heads.count, d))
            offset += part.numel()


def splits(me: RankShard, others: tuple[RankShard, ...], n_blocks: int, block_size: int,
           head_dim: int) -> list[int]:
    """Elements of n_blocks blocks exchanged with each other rank: what `me` sends each target rank
    (me: a source shard, others: the target shards) or receives from each source rank (me: a target
    shard, others: the source shards); an intersection is the same either way."""
    out = []
    for other in others:
        p = piece(me, other)
        out.append(0 if p.empty else 2 * p.layers.count * n_blocks * block_size * p.heads.count * head_dim)
    return out


def write(view: KVView, received: torch.Tensor, splits: list[int], src_shards: tuple[RankShard, ...],
          me_dst: RankShard, blocks: torch.Tensor) -> None:
    """Scatter what each source rank sent into this rank's target view, at the same block ids."""
    offset = 0
    n = blocks.numel()
    _, _, _, bs, _, d = view.tensor.shape
    for src, size in zip(src_shards, splits):
        if size == 0:
            continue
        p = piece(src, me_dst)
        ls, hs = _local(me_dst, p)
        part = received[offset: offset + size].view(n, p.layers.count, 2, bs, p.heads.count, d)
        view.tensor[:, ls, :, :, hs, :].index_copy_(0, blocks, part)
        offset += size


def restore(view: KVView, flat: torch.Tensor, splits: list[int], me_src: RankShard,
            dst_shards: tuple[RankShard, ...], blocks: torch.Tensor) -> None:
    """Rollback: put this rank's source blocks back from its send buffer (a partial write may have
    touched them: the two views alias the same bytes). The inverse of read: intersections are
    symmetric, so it is `write` with the roles of source and target swapped."""
    write(view, flat, splits, dst_shards, me_src, blocks)
