"""Products and row lookups on weights in a GGUF block format, as Triton kernels (weight-only: each block
decoded to float32 in registers, never to memory).

Owns: `quant_linear_triton` (x [M, K] @ W^T, W's blocks uint8 [N, bytes a row] as the file holds them;
each program a tile of rows of x against a tile of weight rows, a run of 32 values at a time decoded
and multiplied with tl.dot: ieee float32 for float32 x, tf32 for bfloat16 x; summed in float32) and
`quant_rows_triton` (rows of W by index, float32: a quantized embedding's lookup). The formats and their
layouts are GGML's, as kernels/cpu/blocks.h decodes them (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: blocks of 32;
Q4_K, Q6_K: blocks of 256, eight runs of 32). The references: kernels/cpu/quant.py's FORMATS for the
geometry, gguf's own decoder in the tests. Never launched at import.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

RUN = 32   # values decoded at a time


@triton.jit
def _byte(p):
    return tl.load(p).to(tl.int32)


@triton.jit
def _half(p):
    """The little-endian fp16 at byte pointer(s) p, as float32."""
    bits = (_byte(p) | (_byte(p + 1) << 8)).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble(q_ptr, j):
    """Value j (0-31) of a 32-value block's 16 bytes of nibbles: byte j % 16, its high half for j >= 16."""
    return (_byte(q_ptr + j % 16) >> (4 * (j // 16))) & 0xF


@triton.jit
def _fifth(bits_ptr, j):
    """Bit j of a Q5 block's 32 fifth bits, as bit 4 of its value."""
    return ((_byte(bits_ptr + j // 8) >> (j % 8)) & 1) << 4


@triton.jit
def _decode(base, s, j, TYPE: tl.constexpr):
    """Run s of the blocks at byte pointers `base` [R, 1], values j [1, 32]: float32 [R, 32]."""
    if TYPE == 8:     # Q8_0
        w = _half(base) * _byte(base + 2 + j).to(tl.int8).to(tl.float32)
    elif TYPE == 2:   # Q4_0
        w = _half(base) * (_nibble(base + 2, j) - 8).to(tl.float32)
    elif TYPE == 3:   # Q4_1
        w = _half(base) * _nibble(base + 4, j).to(tl.float32) + _half(base + 2)
    elif TYPE == 6:   # Q5_0
        w = _half(base) * ((_nibble(base + 6, j) | _fifth(base + 2, j)) - 16).to(tl.float32)
    elif TYPE == 7:   # Q5_1
        w = _half(base) * (_nibble(base + 8, j) | _fifth(base + 4, j)).to(tl.float32) + _half(base + 2)
    elif TYPE == 12:  # Q4_K: run s's 6-bit scale and min, its nibbles the low or high halves of 32 bytes
        first = _byte(base + 4 + s % 4)          # sc (s < 4) / holds sc's top bits (s >= 4)
        second = _byte(base + 8 + s % 4)         # mn (s < 4) / holds mn's top bits (s >= 4)
        packed = _byte(base + 12 + s % 4)        # the low 4 bits of sc and mn for s >= 4
        sc = tl.where(s < 4, first & 63, (packed & 0xF) | ((first >> 6) << 4))
        mn = tl.where(s < 4, second & 63, (packed >> 4) | ((second >> 6) << 4))
        q = (_byte(base + 16 + (s // 2) * 32 + j) >> (4 * (s % 2))) & 0xF
        w = _half(base) * sc.to(tl.float32) * q.to(tl.float32) - _half(base + 2) * mn.to(tl.float32)
    else:             # Q6_K (14): low 4 bits, high 2 bits, a signed scale per 16 values, d last
        n, t = s // 4, s % 4
        low = (_byte(base + n * 64 + (t % 2) * 32 + j) >> (4 * (t // 2))) & 0xF
        high = (_byte(base + 128 + n * 32 + j) >> (2 * t)) & 3
        sc = _byte(base + 192 + n * 8 + 2 * t + j // 16).to(tl.int8).to(tl.float32)
        w = _half(base + 208) * sc * ((low | (high << 4)) - 32).to(tl.float32)
    return w


@triton.jit
def _quant_linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                         TYPE: tl.constexpr, BLOCK_VALUES: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, 32)[None, :]
    rows = w_ptr + tl.where(rn < N, rn, 0).to(tl.int64)[:, None] * stride_wn   # [BLOCK_N, 1]
    xs = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + j                        # [BLOCK_M, 32]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(0, K // 32):
        s = r % (BLOCK_VALUES // 32)
        w = _decode(rows + (r // (BLOCK_VALUES // 32)) * BLOCK_BYTES, s, j, TYPE)   # [BLOCK_N, 32]
        x = tl.load(xs + r * 32, mask=rm[:, None] < M, other=0.0)
        if IEEE:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:   # bfloat16 activations: tf32 products, finer than bf16's, on the same tensor cores
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="tf32")
    out = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _quant_rows_kernel(w_ptr, ids_ptr, out_ptr, stride_wn, K, TYPE: tl.constexpr, BLOCK_VALUES: tl.constexpr,
                       BLOCK_BYTES: tl.constexpr):
    t, r = tl.program_id(0), tl.program_id(1)
    j = tl.arange(0, 32)[None, :]
    row = w_ptr + tl.load(ids_ptr + t) * stride_wn + (r // (BLOCK_VALUES // 32)) * BLOCK_BYTES
    w = _decode(row + tl.zeros((1, 1), dtype=tl.int64), r % (BLOCK_VALUES // 32), j, TYPE)
    tl.store(out_ptr + t.to(tl.int64) * K + r * 32 + j, w)


def _geometry(blocks: torch.Tensor, type_id: int, k: int) -> tuple[int, int]:
    from phaseflip.kernels.cpu.quant import FORMATS, format_of_type   # the served formats' geometry
    fmt = format_of_type(type_id)
    if fmt is None:
        raise ValueError(f"block format {type_id} is not served (served: "
                         f"{', '.join(f'{f.name} = {f.type_id}' for f in FORMATS.values())})")
    if k % fmt.block_values or blocks.shape[1] != fmt.row_bytes(k) or blocks.stride(1) != 1:
        raise ValueError(f"{fmt.name}: blocks {tuple(blocks.shape)} are not rows of {k} values in "
                         f"{fmt.block_values}-value blocks with contiguous rows")
    return fmt.block_values, fmt.block_bytes


def quant_linear_triton(x: torch.Tensor, blocks: torch.Tensor, type_id: int) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) @ W^T, W [N, K] held as `blocks` uint8 [N, bytes a row] of GGML
    type `type_id`: [M, N] in x's dtype, summed in float32."""
    m, k = x.shape
    values, nbytes = _geometry(blocks, type_id, k)
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((m, blocks.shape[0]), dtype=x.dtype, device=x.device)
    if m == 0 or y.shape[1] == 0:
        return y
    block_m = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(y.shape[1], 64))
    _quant_linear_kernel[grid](x, blocks, y, m, y.shape[1], k, x.stride(0), blocks.stride(0), y.stride(0),
                               TYPE=type_id, BLOCK_VALUES=values, BLOCK_BYTES=nbytes, BLOCK_M=block_m,
                               BLOCK_N=64, IEEE=x.dtype == torch.float32)
    return y


def quant_rows_triton(blocks: torch.Tensor, ids: torch.Tensor, type_id: int) -> torch.Tensor:
    """Rows `ids` (int64 [T]) of W, held as `blocks` uint8 [N, bytes a row] of GGML type `type_id`, as
    float32 [T, K]."""
    from phaseflip.kernels.cpu.quant import format_of_type
    fmt = format_of_type(type_id)
    k = blocks.shape[1] // fmt.block_bytes * fmt.block_values if fmt else 0
    values, nbytes = _geometry(blocks, type_id, k)
    out = torch.empty((ids.shape[0], k), dtype=torch.float32, device=blocks.device)
    if ids.shape[0] and k:
        _quant_rows_kernel[(ids.shape[0], k // RUN)](blocks, ids.contiguous(), out, blocks.stride(0), k,
                                                    TYPE=type_id, BLOCK_VALUES=values, BLOCK_BYTES=nbytes)
    return out
