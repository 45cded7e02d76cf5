"""Paged KV block allocator: which fixed-size KV blocks are free, and who holds the rest.

Owns: the pool of block ids [0, num_total_blocks) and the accounting of free vs. allocated ids. Every
capacity number it reports (num_free_blocks, can_allocate) is exactly what `allocate` will deliver
(LESSONS item 4): there is no reserve, no rounding and no other claimant.

Allocation order is deterministic: ids are handed out from the front of the free list and freed ids
go back to its FRONT, so a just-freed block is the first to be reused. The working set of KV memory
stays as small as the load: on the CPU, a FIFO (used before) cycled through the whole pool, so every
new block landed on never-touched pages (a page fault per 4 KiB, cold caches) until the whole pool
was resident.

Must never: import torch, touch KV memory, or allocate part of a request (all or nothing).
"""
from __future__ import annotations

from collections import deque
from typing import Iterable

from phaseflip.engine.requests import Sequence


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        _check_positive_int("num_blocks", num_blocks)
        _check_positive_int("block_size", block_size)
        self.block_size = block_size
        self._num_total_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._allocated: set[int] = set()

    @property
    def num_total_blocks(self) -> int:
        return self._num_total_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._allocated)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens tokens (ceil division)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return 0 <= num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take num_blocks free ids, most recently freed first. Raises (allocating nothing) if too few are free."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self._free):
            raise RuntimeError(f"cannot allocate {num_blocks} KV blocks: only {len(self._free)} of "
                               f"{self._num_total_blocks} are free")
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        self._allocated.update(block_ids)
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Return ids to the front of the free list (the next allocate takes them first, in this order).
        A double free or a foreign id frees nothing."""
        block_ids = list(block_ids)
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block ids freed twice in one call: {block_ids}")
        not_held = [b for b in block_ids if b not in self._allocated]
        if not_held:
            raise ValueError(f"cannot free KV blocks {not_held}: not allocated (double free or an id "
                             f"outside [0, {self._num_total_blocks}))")
        self._allocated.difference_update(block_ids)
        self._free.extendleft(reversed(block_ids))

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
        """Free every block of seq and empty its block table."""
        self.free(seq.block_ids)
        seq.block_ids = []


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
