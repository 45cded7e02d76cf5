"""Products on weights kept in a GGUF block format (kernels/cpu/quant.cpp): the formats served, their
geometry, and `quant_linear` (x @ W^T with W's blocks as the file holds them).

Owns: `FORMATS` (name -> `BlockFormat`: GGML's type id, values and bytes a block), `format_of_type`,
`block_format` (a name, checked: another names what is served), `weight_format`, `storage` and
`storage_name` (what a weight of the arena holds: a quantized one is uint8 [rows, blocks, block bytes],
and the bytes a block takes name its format), `quant_linear`, `few_rows` / `set_few_rows` (up to which
rows of x its products take the few-rows dots), `quant_rows` (rows of W decoded by index: a quantized
embedding's lookup), `dequantize`, and how the products take x: `has_int8_dot`, `int8_x` / `set_int8_x`
(whether they quantize x to int8 per block, a process setting the boot sets from the engine's
block_products), `block_x` (how a report names that) and `quantize_rows_int8` (what x becomes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from phaseflip.kernels.cpu import library


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block format: GGML's id for it, the values a block holds and the bytes it takes."""
    name: str
    type_id: int
    block_values: int
    block_bytes: int

    def row_bytes(self, k: int) -> int:
        """The bytes of a weight row of k values (k a whole number of blocks)."""
        if k % self.block_values:
            raise ValueError(f"{self.name}: a row of {k} values is not a whole number of "
                             f"{self.block_values}-value blocks")
        return k // self.block_values * self.block_bytes


FORMATS = {f.name: f for f in (BlockFormat("Q4_0", 2, 32, 18), BlockFormat("Q4_1", 3, 32, 20),
                                BlockFormat("Q5_0", 6, 32, 22), BlockFormat("Q5_1", 7, 32, 24),
                                BlockFormat("Q8_0", 8, 32, 34), BlockFormat("Q4_K", 12, 256, 144),
                                BlockFormat("Q6_K", 14, 256, 210))}


def block_format(name: str) -> BlockFormat:
    """The format named `name`; another name is an error naming the served ones."""
    if name not in FORMATS:
        raise ValueError(f"block format {name!r} is not served (served: {', '.join(FORMATS)})")
    return FORMATS[name]


FEW_ROWS = 8   # the rows of x the few-rows dots take at once (kernels/cpu/few_rows.h)
_BY_BLOCK_BYTES = {f.block_bytes: f for f in FORMATS.values()}   # each format's block has its own size
_BY_TYPE_ID = {f.type_id: f for f in FORMATS.values()}


def format_of_type(type_id: int) -> BlockFormat | None:
    """The served format with GGML's type id `type_id`; None for another type."""
    return _BY_TYPE_ID.get(type_id)


def weight_format(weight: torch.Tensor) -> BlockFormat | None:
    """The block format of a quantized weight (uint8 [rows, blocks, block bytes]); None for a float one."""
    if weight.dtype != torch.uint8:
        return None
    if weight.dim() != 3 or weight.shape[-1] not in _BY_BLOCK_BYTES:
        raise ValueError(f"a quantized weight is uint8 [rows, blocks, block bytes] with block bytes one of "
                         f"{sorted(_BY_BLOCK_BYTES)}, got {tuple(weight.shape)}")
    return _BY_BLOCK_BYTES[weight.shape[-1]]


def storage(weight: torch.Tensor) -> str:
    """What a weight is stored as: its block format's name, else its dtype's ("float32", "bfloat16")."""
    return storage_name(weight.dtype, tuple(weight.shape))


def storage_name(dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    """storage() of a weight of this dtype and shape."""
    if dtype == torch.uint8 and len(shape) == 3 and shape[-1] in _BY_BLOCK_BYTES:
        return _BY_BLOCK_BYTES[shape[-1]].name
    return str(dtype).removeprefix("torch.")


def quant_linear(x: torch.Tensor, blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) @ W^T, W [N, K] held as `blocks` [N, fmt.row_bytes(K)] uint8: the
    product in x's dtype, summed in float32."""
    return _kernels().cpu_quant_linear(x, blocks, fmt.type_id)


def few_rows(fmt: BlockFormat) -> int:
    """The rows of x up to which fmt's products with int8 x (int8_x) read each weight row once a pass of
    at most 8 rows (the few-rows dots), above which they take the wide integer tile (kernels/cpu/few_rows.h)."""
    return _kernels().cpu_quant_few_rows(fmt.type_id)


def set_few_rows(fmt: BlockFormat, rows: int | None) -> int:
    """Set few_rows(fmt) to `rows` (None: the build's default for this instruction set); returns the limit
    it replaced."""
    return _kernels().cpu_quant_set_few_rows(fmt.type_id, -1 if rows is None else rows)


def quant_rows(blocks: torch.Tensor, ids: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Rows `ids` (int64 [T]) of W, held as `blocks` [N, fmt.row_bytes(K)] uint8, as float32 [T, K]."""
    return _kernels().cpu_quant_rows(blocks, ids, fmt.type_id)


def has_int8_dot() -> bool:
    """Whether the kernels, as built for this CPU, have integer dot products (AVX2; AVX512-VNNI's where
    present): products on blocks can then take x quantized to int8 (int8_x)."""
    return library.quant_linear_op() is not None and bool(_kernels().cpu_quant_has_int8_dot())


def int8_x() -> bool:
    """Whether products on blocks quantize x (of any dtype) to int8 per block of the weights' values (32, or
    256 for the K formats: quantize_rows_int8) for integer products, at every row count (llama.cpp's
    numerics; kernels/cpu/qrow.h, int8.h, int8_wide.h), or multiply x as it is with the decoded weights
    (exact). A process setting: int8 wherever has_int8_dot until set_int8_x."""
    return bool(_kernels().cpu_quant_int8_x())


def set_int8_x(on: bool) -> bool:
    """Set int8_x() (on: only where has_int8_dot); returns the setting it replaced."""
    return bool(_kernels().cpu_quant_set_int8_x(bool(on)))


def block_x(device: str) -> str:
    """How products on blocks see x on `device` (what the weights report says): the CPU's kernels int8 per
    block of the weights' values (int8_x) or x as it is; CUDA's Triton kernels x as it is."""
    if str(device).startswith("cuda"):
        return "as it is (Triton decodes the blocks)"
    if library.quant_linear_op() is not None and int8_x():
        return "rounded to int8 per block of the weights' values, 32 or 256 (llama.cpp's numerics)"
    return "as it is, never rounded (exact)"


def quantize_rows_int8(x: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """x [M, K] as the kernel's int8 products with fmt's blocks see it: each block of fmt.block_values
    values rounded to multiples of max|block| / 127 (float32)."""
    blocks = x.float().reshape(x.shape[0], -1, fmt.block_values)
    amax = blocks.abs().amax(-1, keepdim=True)
    # 127 / amax as one float32 division, as the kernel takes it (a Python number over a tensor is its
    # reciprocal times the number: two roundings, which move a value at k + 0.5 to the other side)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv).clamp(-127, 127) * (amax / 127.0)).reshape(x.shape)


def dequantize(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Every row of W, held as `blocks` [N, fmt.row_bytes(K)] uint8, as float32 [N, K]."""
    return quant_rows(blocks, torch.arange(blocks.shape[0]), fmt)


def _kernels():
    """torch.ops.phaseflip where the CPU kernels are here; else an error saying why they are not."""
    if library.quant_linear_op() is None:
        raise RuntimeError(f"the CPU kernels are not here ({library.kernel_report().get('reason')}): "
                           "quantized weights need them")
    return torch.ops.phaseflip
