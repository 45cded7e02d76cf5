"""Paged KV block allocator: which fixed-size KV blocks are free, who holds the rest, and how many
sequences share each.

Owns: the pool of block ids [0, num_total_blocks), reference counts of allocated ids, and the free
lists. Every capacity number it reports (num_free_blocks, can_allocate) is exactly what `allocate`
will deliver: there is no reserve, no rounding and no other claimant.

Two kinds of free block: plain ones, and (with prefix caching, engine/prefix_cache.py) cached ones,
whose KV still holds a prefix a later prompt can `share`. Allocation takes plain ids first, from the
front of their list, and freed plain ids go back to its FRONT, so a just-freed block is the first to
be reused: the working set of KV memory stays as small as the load (on the CPU, cycling through the
whole pool put every new block on never-touched pages). Only when no plain block is left is a cached
one evicted, least recently freed first; the cached blocks one free releases enter that order last
block first, so a sequence's tail (the part least likely shared) is evicted before its head.

Must never: import torch, touch KV memory, or allocate part of a request (all or nothing).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Iterable

from phaseflip.engine.prefix_cache import PrefixCache
from phaseflip.engine.requests import Sequence


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        _check_positive_int("num_blocks", num_blocks)
        _check_positive_int("block_size", block_size)
        self.block_size = block_size
        self._num_total_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()   # least recently freed first
        self._refs: dict[int, int] = {}                               # allocated id -> sequences holding it
        self.cache = PrefixCache(block_size) if prefix_caching else None

    @property
    def num_total_blocks(self) -> int:
        return self._num_total_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out: plain free ones and cached ones nobody holds."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._refs)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens tokens (ceil division)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return 0 <= num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Take num_blocks free ids: plain ones most recently freed first, then cached ones least
        recently freed first (evicting their prefixes). Raises (allocating nothing) if too few are free."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"cannot allocate {num_blocks} KV blocks: only {self.num_free_blocks} of "
                               f"{self._num_total_blocks} are free")
        block_ids = []
        for _ in range(num_blocks):
            if self._free:
                block_ids.append(self._free.popleft())
            else:
                block, _ = self._cached_free.popitem(last=False)
                self.cache.evict(block)
                block_ids.append(block)
        for b in block_ids:
            self._refs[b] = 1
        return block_ids

    def share(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on cached blocks (a prefix hit): a free one leaves the free list."""
        for b in block_ids:
            if b in self._refs:
                self._refs[b] += 1
            else:
                del self._cached_free[b]
                self._refs[b] = 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each id; an id nobody holds any more becomes free (a cached one stays
        cached, at the recent end of the eviction order; a plain one goes to the front of the free
        list, in this order). A double free or a foreign id frees nothing."""
        block_ids = list(block_ids)
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block ids freed twice in one call: {block_ids}")
        not_held = [b for b in block_ids if b not in self._refs]
        if not_held:
            raise ValueError(f"cannot free KV blocks {not_held}: not allocated (double free or an id "
                             f"outside [0, {self._num_total_blocks}))")
        plain, cached = [], []
        for b in block_ids:
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            del self._refs[b]
            (cached if self.cache is not None and self.cache.is_cached(b) else plain).append(b)
        for b in reversed(cached):  # a sequence's tail is evicted before its head
            self._cached_free[b] = None
        self._free.extendleft(reversed(plain))

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq.block_ids to hold num_tokens tokens: all the missing blocks, or none (returns False)."""
        num_missing = self.blocks_needed(num_tokens) - len(seq.block_ids)
        if num_missing <= 0:
            return True
        if not self.can_allocate(num_missing):
            return False
        seq.block_ids.extend(self.allocate(num_missing))
        return True

    def release(self, seq: Sequence) -> None:
        """Free every block of seq (those it has not dropped already) and empty its block table."""
        self.free(seq.block_ids[seq.num_dropped_blocks:])
        seq.block_ids = []
        seq.num_cached_blocks = seq.num_dropped_blocks = 0
        if self.cache is not None:
            self.cache.release(seq)

    def drop_leading(self, seq: Sequence, count: int) -> int:
        """Free seq's blocks before block `count` that it still holds (they are behind every layer's sliding
        window: never read again); their entries stay in its table, which keeps its positions. Returns how
        many were freed."""
        dropped = seq.block_ids[seq.num_dropped_blocks:count]
        self.free(dropped)
        seq.num_dropped_blocks = max(seq.num_dropped_blocks, count)
        return len(dropped)

    def cache_stats(self) -> dict:
        """The prefix cache's counters; {"enabled": False} without prefix caching."""
        return self.cache.stats() if self.cache is not None else {"enabled": False}

    def carried_blocks(self) -> list[int]:
        """Every block whose KV must survive a flip: those held by sequences, each once however many
        share it, and the cached free ones (so the cache stays valid in the other layout)."""
        return sorted([*self._refs, *self._cached_free])


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
