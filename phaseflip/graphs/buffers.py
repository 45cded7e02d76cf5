"""Static input buffers: allocated once at the largest size any captured step needs.

Owns: StaticBuffers. A captured step reads its inputs from fixed addresses; replay copies the live
inputs into a prefix of each buffer and pads the rest with a declared sentinel. Knows nothing of models.

Staged (the default on CUDA): the host-built inputs (every 8-byte buffer: token ids, positions, slots,
attention metadata, sampling parameters) are one flat device tensor with a host mirror (pinned on CUDA); `fill` writes the
mirror and `upload` moves all of it with ONE asynchronous copy, instead of a synchronous pageable copy
and a padding kernel per buffer. Before the mirror is written again, the previous copy is waited for
(it has normally long finished: the step that read it sampled since). Other buffers (a later PP
stage's received hidden states) live on the device and are filled there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BufferSpec:
    shape: tuple[int, ...]   # full (largest) shape; dim 0 is the one a bucket slices
    dtype: torch.dtype
    pad_value: int | float   # written into the unused tail on every fill (documented sentinel)
    pad_with_last: bool = False  # instead, repeat the last real row (keeps offsets non-decreasing)


class StaticBuffers:
    def __init__(self, specs: dict[str, BufferSpec], device: torch.device | str = "cpu",
                 staged: bool | None = None):
        self.specs = dict(specs)
        device = torch.device(device)
        self.staged = device.type == "cuda" if staged is None else staged
        self.uploads = 0          # staging copies made (one per replayed step)
        self._copied = None       # the CUDA event of the last staging copy
        self.tensors = {name: torch.full(s.shape, s.pad_value, dtype=s.dtype, device=device)
                        for name, s in self.specs.items() if not self._is_staged(name)}
        self._host: dict[str, torch.Tensor] = {}
        names = [name for name in self.specs if self._is_staged(name)]
        if names:
            total = sum(math.prod(self.specs[n].shape) for n in names)
            self._flat = torch.empty(total, dtype=torch.int64, device=device)
            self._host_flat = torch.empty(total, dtype=torch.int64, pin_memory=device.type == "cuda")
            offset = 0
            for name in names:
                spec = self.specs[name]
                numel = math.prod(spec.shape)
                self.tensors[name] = self._flat[offset:offset + numel].view(spec.dtype).view(spec.shape)
                self._host[name] = self._host_flat[offset:offset + numel].view(spec.dtype).view(spec.shape)
                self._host[name].fill_(spec.pad_value)
                offset += numel
            self._flat.copy_(self._host_flat)
        self.tensors = {name: self.tensors[name] for name in self.specs}   # the specs' order

    def _is_staged(self, name: str) -> bool:
        return self.staged and self.specs[name].dtype.itemsize == 8

    def views(self, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        """Leading-dim prefixes of every buffer: `sizes[name]` rows (the full buffer when absent)."""
        return {name: t[:sizes.get(name, t.shape[0])] for name, t in self.tensors.items()}

    def fill(self, name: str, src: torch.Tensor, rows: int) -> None:
        """Copy src into the first len(src) rows and pad rows [len(src), rows) with the sentinel (into
        the host mirror of a staged buffer: the step sees it after `upload`)."""
        staged = name in self._host
        dst = self._host[name] if staged else self.tensors[name]
        n = src.shape[0]
        if src.dim() > 1 and src.shape[-1] > dst.shape[-1]:
            raise ValueError(f"buffer {name!r}: {src.shape[-1]} columns do not fit its {dst.shape[-1]}")
        if n > rows or rows > dst.shape[0]:
            raise ValueError(f"buffer {name!r}: {n} rows do not fit a bucket of {rows} "
                             f"(buffer holds {dst.shape[0]})")
        if staged and self._copied is not None:
            self._copied.synchronize()   # the last copy has read the mirror (it normally has)
            self._copied = None
        # 2-D buffers (block tables) copy into their leading columns; columns past a sequence's
        # length are never read, so they are left as they are.
        dst[:n].narrow(-1, 0, src.shape[-1]).copy_(src) if src.dim() > 1 else dst[:n].copy_(src)
        spec = self.specs[name]
        if spec.pad_with_last and n > 0:
            dst[n:rows].copy_(src[-1].expand_as(dst[n:rows]))
        else:
            dst[n:rows].fill_(spec.pad_value)

    def upload(self) -> None:
        """Make what `fill` wrote into the staged buffers visible to the step: one copy of the whole
        mirror (asynchronous on CUDA). Nothing to do when nothing is staged."""
        if not self._host:
            return
        cuda = self._flat.is_cuda
        self._flat.copy_(self._host_flat, non_blocking=cuda)
        if cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.uploads += 1

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
