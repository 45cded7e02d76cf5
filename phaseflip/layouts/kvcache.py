"""The paged KV region of one rank: one flat buffer, viewed as per-layer K and V caches.

Owns: the allocation of the region and its layer views. The block allocator (engine/blocks.py) hands
out block ids; this module only maps (layer, block, slot) to bytes. Never reallocated after boot.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
    def numel(self) -> int:
        return 2 * self.num_layers * self.num_blocks * self.block_size * self.num_kv_heads * self.head_dim

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        return self.numel // self.num_blocks * torch.empty((), dtype=dtype).element_size()


def zeros(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed buffer. On the CPU it comes from calloc (numpy), so untouched pages cost nothing until
    a block is first written: a large pool boots in milliseconds instead of a multi-GB memset."""
    if torch.device(device).type != "cpu":
        return torch.zeros(numel, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(numel * itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype)


class KVCache:
    def __init__(self, shape: KVShape, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.shape = shape
        self.dtype = dtype
        self.buffer = zeros(shape.numel, dtype, device)
        s = shape
        # [2 (k, v), layers, blocks, block_size, kv heads, head_dim]
        self._view = self.buffer.view(2, s.num_layers, s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim)

    @property
    def num_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of local layer i, each [num_blocks, block_size, kv heads, head_dim]."""
        return self._view[0, i], self._view[1, i]
