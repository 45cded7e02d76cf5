"""The paged KV region of one rank: ONE buffer, with one view per layout over the same bytes.

Owns: the allocation of the region (once, at boot) and its views. The region is block-major: block b
of a rank is one contiguous stretch of `block_stride` elements, and each layout's view lays its part of
the block out inside that stretch:
  PP view: [num_blocks, layers of this stage, 2 (k, v), block_size, all kv heads,   head_dim]
  TP view: [num_blocks, all layers,           2 (k, v), block_size, this rank's kv heads, head_dim]
The stride is the larger of the two views' block sizes, so a block's bytes are the same bytes in both
views: a flip that rewrites block b touches nothing but block b. That is what lets the flip move live
KV a few blocks at a time through a small staging buffer (rank/flip.py) instead of copying all of
it out first. The planner makes both views hold the same number of blocks, so block ids (kept by the
controller) mean the same thing in both. The block allocator hands out ids; this module maps ids to bytes.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self):
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KV cache {name}={getattr(self, name)} must be >= 1")

    @property
    def block_dims(self) -> tuple[int, ...]:
        """One block's layout: [layers, 2 (k, v), block_size, kv heads, head_dim]."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_numel(self) -> int:
        n = 1
        for d in self.block_dims:
            n *= d
        return n

    @property
    def numel(self) -> int:
        return self.num_blocks * self.block_numel

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        return self.block_numel * torch.empty((), dtype=dtype).element_size()


def zeros(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed buffer. On the CPU it is an anonymous mapping: the kernel hands out zero pages lazily,
    4 KiB at a time, so a large pool boots in milliseconds instead of a multi-GB memset and a first
    write costs a small page fault. (Not numpy's zeros: it asks for transparent huge pages, so the
    first write into each 2 MiB zeroes all of it, and a flip writing a few MB of scattered blocks
    stalls for hundreds of ms.)"""
    if torch.device(device).type != "cpu":
        return torch.zeros(numel, dtype=dtype, device=device)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes].view(dtype)


def _strides(dims: tuple[int, ...], outer: int) -> tuple[int, ...]:
    """Row-major strides of dims[1:], with `outer` as the stride of dims[0]."""
    inner = [1]
    for d in reversed(dims[2:]):
        inner.append(inner[-1] * d)
    return (outer, *reversed(inner))


class KVView:
    """One layout's view of the region: `tensor` is [num_blocks, layers, 2, block_size, heads, D],
    starting at the region's first element, with block_stride elements between blocks."""
    def __init__(self, buffer: torch.Tensor, shape: KVShape, block_stride: int | None = None):
        self.shape = shape
        self.block_stride = shape.block_numel if block_stride is None else block_stride
        if self.block_stride < shape.block_numel:
            raise ValueError(f"block_stride={self.block_stride} is smaller than a block ({shape.block_numel})")
        dims = (shape.num_blocks, *shape.block_dims)
        self.tensor = buffer.as_strided(dims, _strides(dims, self.block_stride), buffer.storage_offset())

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of local layer i, each [num_blocks, block_size, kv heads, head_dim]."""
        return self.tensor[:, i, 0], self.tensor[:, i, 1]


class KVRegion:
    def __init__(self, shapes: dict[str, KVShape], dtype: torch.dtype, device: torch.device | str = "cpu"):
        blocks = {s.num_blocks for s in shapes.values()}
        if len(blocks) != 1:
            raise ValueError(f"every layout's KV view must hold the same number of blocks, got {blocks}")
        self.dtype = dtype
        self.block_stride = max(s.block_numel for s in shapes.values())
        self.buffer = zeros(blocks.pop() * self.block_stride, dtype, device)
        self.views = {name: KVView(self.buffer, s, self.block_stride) for name, s in shapes.items()}

    @property
    def num_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def view(self, layout: str) -> KVView:
        return self.views[layout]
