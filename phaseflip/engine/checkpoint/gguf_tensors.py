"""The tensors of a GGUF file as the file stores them, memory-mapped (gguf_file.py reads the index).

Owns: `GGUFTensor` (a tensor's name, its shape in HF's order, rows first, the type the file stores it
in, and its data: float values for F32 / F16 / BF16, or for a block format the engine serves
(kernels/cpu/quant.py) its blocks as they lie, uint8 [rows, bytes a row], which the quantized products
read without decoding them first) and `read_tensors` (every tensor, in file order). A tensor of any
other type is a CheckpointError naming it and its type, raised before any data is touched. Nothing
here turns a file into a model: names, llama.cpp's Q/K row order and the config are the loader's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from phaseflip.engine.checkpoint.gguf_file import TensorInfo, read_gguf, type_name
from phaseflip.engine.checkpoint.loader import CheckpointError
from phaseflip.kernels.cpu.quant import FORMATS, BlockFormat

FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: `data` holds float values (`fmt` None) or fmt's blocks, uint8
    [shape[0], fmt.row_bytes(shape[1])] (views of the memory-mapped file: read-only)."""
    name: str
    shape: tuple[int, ...]
    stored: str
    data: torch.Tensor
    fmt: BlockFormat | None = None


def read_tensors(path: str | Path) -> list[GGUFTensor]:
    """Every tensor of the GGUF file at path, in file order (see the module docstring)."""
    file = read_gguf(path)
    stored = {name: type_name(info.type_id) for name, info in file.tensors.items()}
    for name, kind in stored.items():   # every type checked before any data is wrapped
        if kind not in FLOAT_TYPES and kind not in FORMATS:
            raise CheckpointError(f"{path}: tensor {name!r} is stored as {kind}, which is neither loaded "
                                  f"({', '.join(FLOAT_TYPES)}) nor served in its blocks ({', '.join(FORMATS)})")
    mapped = torch.from_numpy(file.mapped())
    return [_tensor(info, stored[name], mapped) for name, info in file.tensors.items()]


def _tensor(info: TensorInfo, stored: str, mapped: torch.Tensor) -> GGUFTensor:
    shape = tuple(reversed(info.dims))   # GGUF lists the fastest-moving dimension first
    data = mapped[info.offset:info.offset + info.num_bytes]
    if stored in FLOAT_TYPES:
        return GGUFTensor(info.name, shape, stored, data.view(FLOAT_TYPES[stored]).reshape(shape))
    fmt = FORMATS[stored]
    rows = math.prod(shape[:-1])   # 1 for a vector
    return GGUFTensor(info.name, shape, stored, data.reshape(rows, fmt.row_bytes(shape[-1])), fmt)
