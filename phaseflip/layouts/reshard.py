"""Live-KV reshard between two layouts' views of the same region: read -> exchange -> write.

Owns: which slice of every live block each rank sends to each other rank, and the three legs.
Rank r holds (layers A_r) x (kv heads A_r) in the source layout and must end with (layers B_s) x
(kv heads B_s) in the target: r sends s the intersection, over one all_to_all. The read copies the
live blocks straight into the send buffer BEFORE any write, because the two views alias the same
bytes; that buffer is also what a rollback restores from.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from phaseflip.layouts.kvcache import KVView
from phaseflip.layouts.spec import RankShard, Span


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


def read(view: KVView, blocks: torch.Tensor, me_src: RankShard, dst_shards: tuple[RankShard, ...]):
    """Copy, per destination rank, its slice of the live blocks straight into one flat send buffer
    (one copy: no staging clone, no concatenation). Returns (flat buffer, split sizes). The buffer
    holds every live byte this rank has (the target shards cover all layers and heads), so it is also
    what a rollback restores the source view from."""
    n_live = blocks.numel()
    _, _, _, bs, _, d = view.tensor.shape
    shapes = [None if x is None else (2, x[2].layers.count, n_live, bs, x[2].heads.count, d)
              for x in _pieces(me_src, dst_shards)]
    splits = [0 if sh is None else 2 * sh[1] * n_live * bs * sh[4] * d for sh in shapes]
    flat = view.tensor.new_empty(sum(splits))
    offset = 0
    for x, sh, size in zip(_pieces(me_src, dst_shards), shapes, splits):
        if x is not None:
            ls, hs, _ = x
            torch.index_select(view.tensor[:, ls, :, :, hs, :], 2, blocks, out=flat[offset: offset + size].view(sh))
            offset += size
    return flat, splits


def recv_splits(src_shards: tuple[RankShard, ...], me_dst: RankShard, n_live: int, block_size: int,
                head_dim: int) -> list[int]:
    out = []
    for src in src_shards:
        p = piece(src, me_dst)
        out.append(0 if p.empty else 2 * p.layers.count * n_live * block_size * p.heads.count * head_dim)
    return out


def write(view: KVView, received: torch.Tensor, splits: list[int], src_shards: tuple[RankShard, ...],
          me_dst: RankShard, blocks: torch.Tensor) -> None:
    """Scatter what each source rank sent into this rank's target view, at the same block ids."""
    offset = 0
    n_live = blocks.numel()
    _, _, _, bs, _, d = view.tensor.shape
    for src, size in zip(src_shards, splits):
        if size == 0:
            continue
        p = piece(src, me_dst)
        ls, hs = _local(me_dst, p)
        chunk = received[offset: offset + size].view(2, p.layers.count, n_live, bs, p.heads.count, d)
        view.tensor[:, ls, :, :, hs, :].index_copy_(2, blocks, chunk)
        offset += size


def restore(view: KVView, flat: torch.Tensor, splits: list[int], me_src: RankShard,
            dst_shards: tuple[RankShard, ...], blocks: torch.Tensor) -> None:
    """Rollback: put this rank's live source blocks back from its send buffer (a partial write may
    have touched them: the two views alias the same bytes). The inverse of read: intersections are
    symmetric, so it is `write` with the roles of source and target swapped."""
    write(view, flat, splits, dst_shards, me_src, blocks)
