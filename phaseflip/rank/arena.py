"""WeightArena: one device buffer per rank holding the active layout's weights at fixed offsets.

Owns: packing a layout's weights into a host image (once, at boot; pinned on CUDA): memory allocated
once, each source tensor copied once straight into its slot; the arena buffer (allocated once, at
boot), the per-layout views into it, and `refill(layout)`: ONE contiguous host->device copy. In
resident mode both images sit side by side in the arena and a flip copies nothing; on the CPU, where
the host is the device, resident images are packed into the arena itself (no second copy). A flip may
call `refill`; it must never call `allocate_arena` or `pack_image` (restore, never rebuild: tests
fence those two entry points). `resident_images` decides, from the park option, which of the two it is.
"""
from __future__ import annotations

import mmap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from phaseflip.kernels.cpu.quant import FORMATS, block_x, storage_name
from phaseflip.rank.weights import RankWeights, Stacked, replace_tensors

ALIGN = 256  # bytes; every tensor starts on an aligned offset
HUGE_PAGE = 2 << 20   # bytes: a transparent huge page where base pages are 4 KiB (x86-64, most arm64)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MADV_POPULATE_WRITE = 23   # linux/mman.h, Linux 5.14+ (Python's mmap module does not name it)


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
    in_arena: bool = False      # packed into the (CPU) arena itself: holds no bytes of its own

    @property
    def num_bytes(self) -> int:
        return self.data.numel()


EXPERT_WEIGHTS = ("experts_gate_up", "experts_down")


def weight_report(image: HostImage, experts_read: float = 1.0, device: str = "cpu") -> dict:
    """What a layout's weights are stored as: bytes per storage type (a GGUF block format by its name,
    else the dtype's), each tensor's storage, the bytes one decode token reads (every weight once,
    of an embedding that is not also the head only the one row it looks up, of an MoE's experts the
    fraction `experts_read` a token routes to: top_k / num_experts), and how products on blocks see x on
    `device` (quant.block_x), where a weight is in blocks (else None)."""
    names_at = Counter(slot.offset for slot in image.slots.values())   # tied tensors share a slot
    tensors = {name: storage_name(slot.dtype, slot.shape) for name, slot in image.slots.items()}
    by_type: dict[str, int] = {}
    read = 0
    for name, slot in {slot.offset: (name, slot) for name, slot in image.slots.items()}.values():
        by_type[tensors[name]] = by_type.get(tensors[name], 0) + slot.num_bytes
        one_row = name == "embed_tokens" and names_at[slot.offset] == 1
        read += (slot.num_bytes // slot.shape[0] if one_row else
                 round(slot.num_bytes * experts_read) if name.endswith(EXPERT_WEIGHTS) else slot.num_bytes)
    blocks = any(kind in FORMATS for kind in by_type)
    return {"bytes_by_storage": by_type, "storage": tensors, "bytes_read_per_token": read,
            "block_products_x": block_x(device) if blocks else None}


def experts_read(cfg) -> float:
    """The fraction of an MoE layer's expert weights one token reads (1 for a dense model)."""
    return 1.0 if cfg.moe is None else cfg.moe.top_k / cfg.moe.num_experts


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _views(buf: torch.Tensor, base: int, slots: dict[str, Slot]) -> dict[str, torch.Tensor]:
    return {name: buf[base + s.offset: base + s.offset + s.num_bytes].view(s.dtype).view(s.shape)
            for name, s in slots.items()}


def image_slots(weights: RankWeights) -> tuple[dict[str, Slot], int]:
    """Where each tensor of a layout goes in its image, and the image's size (from shapes only)."""
    slots, seen, offset = {}, {}, 0
    for name, t in weights.tensors().items():
        key = id(t) if isinstance(t, Stacked) else (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if key not in seen:
            seen[key] = Slot(offset, tuple(t.shape), t.dtype)
            offset = _align(offset + seen[key].num_bytes)
        slots[name] = seen[key]
    return slots, offset


def host_bytes(num_bytes: int, pin: bool = False) -> torch.Tensor:
    """num_bytes of host memory to pack into: pinned on CUDA; on the CPU (Linux) a private mapping on
    transparent huge pages where the kernel offers them (`_huge_pages`), else one whose pages the
    kernel populates in one call (MAP_POPULATE) instead of one fault per page while packing, which
    packs faster."""
    if pin or num_bytes == 0 or not hasattr(mmap, "MAP_POPULATE"):
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin)
    if num_bytes >= HUGE_PAGE and thp_available():
        return _huge_pages(num_bytes)
    region = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    return torch.frombuffer(region, dtype=torch.uint8)   # keeps the mapping alive while it lives


def thp_available() -> bool:
    """Whether this kernel gives transparent huge pages to a mapping that asks (madvise) for them."""
    try:
        return hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def _huge_pages(num_bytes: int) -> torch.Tensor:
    """A mapping whose whole 2 MiB spans, from a 2 MiB boundary on, ask for huge pages (the last partial
    span stays on 4 KiB pages: the mapping holds no byte past num_bytes, as the memory ledger counts it),
    populated in one call (one write per 4 KiB on a kernel older than MADV_POPULATE_WRITE).
    A decode step reads every weight once: through 4 KiB pages each 4 KiB costs a TLB miss, and the
    steps run several percent slower than on huge pages."""
    region = mmap.mmap(-1, num_bytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)   # keeps the mapping alive while it lives
    start = -whole.data_ptr() % HUGE_PAGE
    region.madvise(mmap.MADV_HUGEPAGE, start, num_bytes // HUGE_PAGE * HUGE_PAGE)
    data = whole[start:start + num_bytes]
    try:
        region.madvise(MADV_POPULATE_WRITE, start, -(-num_bytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    except OSError:
        data[::mmap.PAGESIZE].fill_(0)
    return data


def pack_image(weights: RankWeights, pin: bool = False, into: torch.Tensor | None = None) -> HostImage:
    """Pack a layout's weights into one host buffer (boot only): allocated once (or `into`, a region
    of the CPU arena), each source copied once into its slot: a view of the checkpoint (strided for
    a column share) or Stacked row blocks, never a temporary of its own."""
    slots, num_bytes = image_slots(weights)
    data = host_bytes(num_bytes, pin) if into is None else into[:num_bytes]
    views, done = _views(data, 0, slots), set()
    for name, t in weights.tensors().items():
        if slots[name].offset in done:  # a tied tensor, already copied
            continue
        done.add(slots[name].offset)
        if isinstance(t, Stacked):
            t.copy_into(views[name])
        else:
            views[name].copy_(t)
    return HostImage(data, slots, in_arena=into is not None)


def arena_bases(sizes: dict[str, int], resident: bool) -> tuple[dict[str, int], int]:
    """Each layout's offset in the arena and the arena's size: resident, side by side; parked, every
    layout at offset 0 of a buffer that fits the largest."""
    bases, base = {}, 0
    for name, size in sizes.items():
        bases[name] = base
        base = base + _align(size) if resident else 0
    return bases, base if resident else max(sizes.values())


def allocate_arena(num_bytes: int, device: str) -> torch.Tensor:
    """The arena buffer (boot only)."""
    if device == "cpu":
        return host_bytes(num_bytes)
    return torch.empty(num_bytes, dtype=torch.uint8, device=device)


class WeightArena:
    def __init__(self, images: dict[str, HostImage], templates: dict[str, RankWeights], device: str,
                 resident: bool, buffer: torch.Tensor | None = None):
        """`buffer`: the arena the images were packed into (CPU, resident), else one is allocated."""
        self.images = images
        self.resident = resident
        self.bases, num_bytes = arena_bases({name: img.num_bytes for name, img in images.items()}, resident)
        self.buffer = allocate_arena(num_bytes, device) if buffer is None else buffer
        self.weights = {name: replace_tensors(templates[name], _views(self.buffer, self.bases[name],
                                                                      img.slots))
                        for name, img in images.items()}
        self.active: str | None = None
        if resident:
            for name in images:
                if not images[name].in_arena:
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


def resident_images(park: str, device: str, sizes: dict[str, int]) -> bool:
    """Whether the layouts' images (bytes by layout) all sit in the arena, side by side (a flip copies
    nothing), or the inactive one waits in a host image: park "never" or one layout, resident; "always",
    parked; "auto", resident on the CPU (the host is the device) and on CUDA where they take under half
    the device's free memory."""
    if park == "never" or len(sizes) == 1:
        return True
    if park == "always":
        return False
    return device == "cpu" or sum(sizes.values()) < 0.5 * torch.cuda.mem_get_info()[0]
