"""The paged KV region of one rank: ONE buffer, with one view per layout over the same bytes.

Owns: the allocation of the region (once, at boot) and its views:
  PP view: [2 (k, v), layers of this stage, num_blocks, block_size, all kv heads,   head_dim]
  TP view: [2 (k, v), all layers,           num_blocks, block_size, this rank's kv heads, head_dim]
The planner makes both views hold the same number of blocks, so block ids (kept by the controller)
mean the same thing in both. The block allocator hands out ids; this module maps ids to bytes.
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
    def dims(self) -> tuple[int, ...]:
        return (2, self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        return self.numel // self.num_blocks * torch.empty((), dtype=dtype).element_size()


def zeros(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed buffer. On the CPU it is an anonymous mapping: the kernel hands out zero pages lazily,
    4 KiB at a time, so a large pool boots in milliseconds instead of a multi-GB memset and a first
    write costs a small page fault. (numpy's zeros, used before, asks for transparent huge pages: the
    first write into each 2 MiB zeroed all of it, and a flip writing a few MB of scattered blocks
    stalled for hundreds of ms; 256 scattered first writes measured 1281 ms there, 0.9 ms here.)"""
    if torch.device(device).type != "cpu":
        return torch.zeros(numel, dtype=dtype, device=device)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes].view(dtype)


class KVView:
    """One layout's view of the region."""
    def __init__(self, buffer: torch.Tensor, shape: KVShape):
        self.shape = shape
        self.tensor = buffer[:shape.numel].view(shape.dims)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of local layer i, each [num_blocks, block_size, kv heads, head_dim]."""
        return self.tensor[0, i], self.tensor[1, i]


class KVRegion:
    def __init__(self, shapes: dict[str, KVShape], dtype: torch.dtype, device: torch.device | str = "cpu"):
        blocks = {s.num_blocks for s in shapes.values()}
        if len(blocks) != 1:
            raise ValueError(f"every layout's KV view must hold the same number of blocks, got {blocks}")
        self.dtype = dtype
        self.buffer = zeros(max(s.numel for s in shapes.values()), dtype, device)
        self.views = {name: KVView(self.buffer, s) for name, s in shapes.items()}

    @property
    def num_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def view(self, layout: str) -> KVView:
        return self.views[layout]
