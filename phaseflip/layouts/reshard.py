"""Live-KV reshard between two layouts' views of the same region: read -> exchange -> write.

Owns: which slice of every live block each rank sends to each other rank, and the three legs.
Rank r holds (layers A_r) x (kv heads A_r) in the source layout and must end with (layers B_s) x
(kv heads B_s) in the target: r sends s the intersection, over one all_to_all. The read copies the
live blocks out (staging on the host side of the wire) BEFORE any write, because the two views alias
the same bytes; the staged copy is also what a rollback restores from.
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


def read(view: KVView, blocks: torch.Tensor) -> torch.Tensor:
    """Copy the live blocks out of a view: [2, layers, n_live, block_size, heads, D]."""
    return view.tensor[:, :, blocks].clone()


def send_buffer(staged: torch.Tensor, me_src: RankShard, dst_shards: tuple[RankShard, ...]):
    """Flatten, per destination rank, the slice it needs; returns (flat buffer, split sizes)."""
    parts, splits = [], []
    for dst in dst_shards:
        p = piece(me_src, dst)
        if p.empty:
            splits.append(0)
            continue
        ls, hs = _local(me_src, p)
        part = staged[:, ls, :, :, hs, :].reshape(-1)
        parts.append(part)
        splits.append(part.numel())
    flat = torch.cat(parts) if parts else staged.new_empty(0)
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


def restore(view: KVView, staged: torch.Tensor, blocks: torch.Tensor) -> None:
    """Rollback: put the staged source blocks back (a partial write may have touched them)."""
    view.tensor.index_copy_(2, blocks, staged)
