"""WeightArena: one device buffer per rank holding the active layout's weights at fixed offsets.

Owns: packing a layout's weights into a host image (once, at boot; pinned on CUDA), the arena buffer
(allocated once, at boot), the per-layout views into it, and `refill(layout)`: ONE contiguous
host->device copy. In resident mode both images sit side by side in the arena and a flip copies
nothing. A flip may call `refill`; it must never call `allocate_arena` or `pack_image` (restore, never
rebuild: tests fence those two entry points).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from phaseflip.layouts.shard import RankWeights, replace_tensors

ALIGN = 256  # bytes; every tensor starts on an aligned offset


@dataclass(frozen=True)
class Slot:
    offset: int                 # bytes from the start of the image
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class HostImage:
    data: torch.Tensor          # uint8 [num_bytes] on the host (pinned on CUDA)
    slots: dict[str, Slot]      # tensor name -> where it lives (tied tensors share a slot)

    @property
    def num_bytes(self) -> int:
        return self.data.numel()


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _views(buf: torch.Tensor, base: int, slots: dict[str, Slot]) -> dict[str, torch.Tensor]:
    return {name: buf[base + s.offset: base + s.offset + s.num_bytes].view(s.dtype).view(s.shape)
            for name, s in slots.items()}


def pack_image(weights: RankWeights, pin: bool = False) -> HostImage:
    """Pack a layout's weights into one host buffer (boot only)."""
    slots, seen, offset = {}, {}, 0
    tensors = weights.tensors()
    for name, t in tensors.items():
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if key not in seen:
            seen[key] = Slot(offset, tuple(t.shape), t.dtype)
            offset = _align(offset + seen[key].num_bytes)
        slots[name] = seen[key]
    data = torch.empty(offset, dtype=torch.uint8, pin_memory=pin)
    for name, view in _views(data, 0, slots).items():
        view.copy_(tensors[name])
    return HostImage(data, slots)


def allocate_arena(num_bytes: int, device: str) -> torch.Tensor:
    """The arena buffer (boot only)."""
    return torch.empty(num_bytes, dtype=torch.uint8, device=device)


class WeightArena:
    def __init__(self, images: dict[str, HostImage], templates: dict[str, RankWeights], device: str,
                 resident: bool):
        self.images = images
        self.resident = resident
        sizes = {name: img.num_bytes for name, img in images.items()}
        self.bases = {}
        base = 0
        for name in images:  # resident: side by side; parked: every layout at offset 0
            self.bases[name] = base
            base = base + _align(sizes[name]) if resident else 0
        self.buffer = allocate_arena(base if resident else max(sizes.values()), device)
        self.weights = {name: replace_tensors(templates[name], _views(self.buffer, self.bases[name],
                                                                      img.slots))
                        for name, img in images.items()}
        self.active: str | None = None
        if resident:
            for name in images:
                self._copy_in(name)

    @property
    def num_bytes(self) -> int:
        return self.buffer.numel()

    def _copy_in(self, layout: str) -> int:
        img = self.images[layout]
        base = self.bases[layout]
        self.buffer[base: base + img.num_bytes].copy_(img.data, non_blocking=True)
        return img.num_bytes

    def refill(self, layout: str) -> int:
        """Make `layout`'s weights live in the arena; returns the bytes copied (0 when resident)."""
        copied = 0 if self.resident else self._copy_in(layout)
        self.active = layout
        return copied
