"""GGUF blocks decoded with torch ops: the reference the Triton quantized kernels are checked against
(kernels/selfcheck.py, on machines without the gguf package or our C++ kernels), itself tested against
gguf's own decoder (tests/kernels/test_quant.py).

Owns: `dequantize` (blocks uint8 [N, bytes a row] of a GGML type id -> float32 [N, K]) and `random_blocks`
(random bytes with small finite scales: every bit pattern of the values); the layouts are GGML's, as
kernels/cpu/blocks.h describes them.
"""
from __future__ import annotations

import torch

_GEOMETRY = {8: (32, 34), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 12: (256, 144), 14: (256, 210)}
_SCALES_AT = {8: (0,), 2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 12: (0, 2), 14: (208,)}   # their fp16 scales


def _half(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of each block, float32 [..., 1]."""
    return b[..., at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """A 32-value block's 16 bytes of nibbles in value order (low halves, then high halves)."""
    return torch.cat([q & 0xF, q >> 4], dim=-1).int()


def _fifths(bits: torch.Tensor) -> torch.Tensor:
    """A Q5 block's 4 bytes of fifth bits as bit 4 of its 32 values."""
    shifts = torch.arange(8, device=bits.device)
    return (((bits.int().unsqueeze(-1) >> shifts) & 1) << 4).flatten(-2)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    s = b[..., 4:16].int()
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], dim=-1)
    mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    qs = b[..., 16:144].int().unflatten(-1, (4, 32))
    q = torch.stack([qs & 0xF, qs >> 4], dim=-2).flatten(-3, -2)          # [..., 8 runs, 32]
    w = _half(b, 0).unsqueeze(-1) * sc.unsqueeze(-1) * q - _half(b, 2).unsqueeze(-1) * mn.unsqueeze(-1)
    return w.flatten(-2)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    halves = []
    for n in range(2):
        ql, qh = b[..., n * 64:(n + 1) * 64].int(), b[..., 128 + n * 32:128 + (n + 1) * 32].int()
        parts = [(ql[..., :32] & 0xF) | ((qh & 3) << 4), (ql[..., 32:] & 0xF) | (((qh >> 2) & 3) << 4),
                 (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)]
        halves += parts
    q = torch.cat(halves, dim=-1) - 32                                      # [..., 256]
    sc = b[..., 192:208].contiguous().view(torch.int8).float()               # one a 16 values
    return (_half(b, 208).unsqueeze(-1) * sc.unsqueeze(-1) * q.unflatten(-1, (16, 16))).flatten(-2)


def dequantize(blocks: torch.Tensor, type_id: int) -> torch.Tensor:
    """Every row of W held as `blocks` uint8 [N, bytes a row] of GGML type `type_id`, float32 [N, K]."""
    if type_id not in _GEOMETRY:
        raise ValueError(f"block format {type_id} is not served (served: {sorted(_GEOMETRY)})")
    values, nbytes = _GEOMETRY[type_id]
    b = blocks.reshape(blocks.shape[0], -1, nbytes)
    if type_id == 8:
        w = _half(b, 0) * b[..., 2:34].contiguous().view(torch.int8).float()
    elif type_id in (2, 3):
        d, q = _half(b, 0), _nibbles(b[..., 2 + 2 * (type_id == 3):])
        w = d * (q - 8) if type_id == 2 else d * q + _half(b, 2)
    elif type_id in (6, 7):
        at = 2 if type_id == 6 else 4
        q = _nibbles(b[..., at + 4:at + 20]) | _fifths(b[..., at:at + 4])
        w = _half(b, 0) * (q - 16) if type_id == 6 else _half(b, 0) * q + _half(b, 2)
    elif type_id == 12:
        w = _q4_k(b)
    else:
        w = _q6_k(b)
    return w.reshape(blocks.shape[0], -1).float()


def random_blocks(type_id: int, n: int, k: int, seed: int, scale: float = 0.01, device="cpu") -> torch.Tensor:
    """n rows of k values as random blocks of GGML type `type_id` (uint8 [n, bytes a row], drawn on
    `device`): random bytes, each fp16 scale uniform in [scale / 10, scale]."""
    values, nbytes = _GEOMETRY[type_id]
    g = torch.Generator(device=device).manual_seed(seed)
    b = torch.randint(0, 256, (n, k // values, nbytes), generator=g, dtype=torch.uint8, device=device)
    for at in _SCALES_AT[type_id]:
        half = (torch.rand(n, k // values, generator=g, device=device) * 0.9 + 0.1) * scale
        b[..., at:at + 2] = half.to(torch.float16).view(torch.uint8).view(n, k // values, 2)
    return b.reshape(n, -1)
