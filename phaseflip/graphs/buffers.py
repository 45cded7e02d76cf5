"""Static input buffers: allocated once at the largest size any captured step needs.

Owns: StaticBuffers. A captured step reads its inputs from fixed addresses; replay copies the live
inputs into a prefix of each buffer and pads the rest with a declared sentinel. Knows nothing of models.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BufferSpec:
    shape: tuple[int, ...]   # full (largest) shape; dim 0 is the one a bucket slices
    dtype: torch.dtype
    pad_value: int | float   # written into the unused tail on every fill (documented sentinel)
    pad_with_last: bool = False  # instead, repeat the last real row (keeps offsets non-decreasing)


class StaticBuffers:
    def __init__(self, specs: dict[str, BufferSpec], device: torch.device | str = "cpu"):
        self.specs = dict(specs)
        self.tensors = {name: torch.full(s.shape, s.pad_value, dtype=s.dtype, device=device)
                        for name, s in self.specs.items()}

    def views(self, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        """Leading-dim prefixes of every buffer: `sizes[name]` rows (the full buffer when absent)."""
        return {name: t[:sizes.get(name, t.shape[0])] for name, t in self.tensors.items()}

    def fill(self, name: str, src: torch.Tensor, rows: int) -> None:
        """Copy src into the first len(src) rows and pad rows [len(src), rows) with the sentinel."""
        dst = self.tensors[name]
        n = src.shape[0]
        if src.dim() > 1 and src.shape[-1] > dst.shape[-1]:
            raise ValueError(f"buffer {name!r}: {src.shape[-1]} columns do not fit its {dst.shape[-1]}")
        if n > rows or rows > dst.shape[0]:
            raise ValueError(f"buffer {name!r}: {n} rows do not fit a bucket of {rows} "
                             f"(buffer holds {dst.shape[0]})")
        # 2-D buffers (block tables) copy into their leading columns; columns past a sequence's
        # length are never read, so they are left as they are.
        dst[:n].narrow(-1, 0, src.shape[-1]).copy_(src) if src.dim() > 1 else dst[:n].copy_(src)
        spec = self.specs[name]
        if spec.pad_with_last and n > 0:
            dst[n:rows].copy_(src[-1].expand_as(dst[n:rows]))
        else:
            dst[n:rows].fill_(spec.pad_value)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
