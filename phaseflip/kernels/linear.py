"""Dense projections (x @ W^T) for the model maths on the CPU: oneDNN's GEMM on a ladder of row counts,
and the weight-stationary form for a few rows.

Owns: `linear`, the row ladder (`row_bucket`) and `warm`, which builds every ladder GEMM at boot.
- torch's CPU F.linear calls MKL's sgemm, which on the project's AMD CPUs (Zen, AVX-512) runs its AVX2
  code: ~210 GFLOPS on 2 cores at 512 rows. oneDNN, which torch also ships (the op inductor's CPU
  fusions call, `mkldnn::_linear_pointwise`), picks its kernel by the CPU's features and reaches ~460 on
  the same shapes (SmolLM2-135M's projections, torch 2.13; at 64 rows 260-350 against 150-180).
- oneDNN builds (JIT-compiles) one GEMM per row count and keeps it; with the heap the allocator keeps
  for its scratch, each costs ~0.5 MB plus ~4 bytes per output element (measured: 0.7 MB at 64 x 3072,
  4.7 MB at ~400 x 3072). Fed every row count a server meets, a rank grew by 200 MB in 200 calls. So
  rows are padded up to a ladder (multiples of 8 to 64, then 8 steps per doubling: padding <= 12.5%; a
  full 512-token chunk is on it and pays no copy) and `warm` builds every ladder GEMM a rank can meet
  at boot, like a graph capture: nothing is built later, and what the GEMMs hold is measured then.
- For a handful of rows (decode) GEMMs stream the weight at well below the memory bandwidth, while the
  product written W @ x^T takes MKL's skinny GEMM path and streams it near the bandwidth (every
  projection of a step, weights out of cache: 1 row 33.7 -> 16.2 ms, 2 rows 59.0 -> 16.6). One row is
  run as two (a copy of it): the one-column product dispatches to GEMV, the slow path again.
The plain weight is used as it lies in the arena (no packed copy: a flip refills the arena in place).
CUDA tensors, dtypes other than float32 and traced code (torch.compile) take F.linear.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F

from phaseflip.kernels.op_registry import define_op

GEMV_ROWS = 1     # rows a compiled CPU step multiplies with inductor's own reduction (measured)
SMALL_BATCH = 4   # rows up to which the weight-stationary form is used on the CPU

_onednn = None    # the oneDNN op, resolved on first use (no import-time work); False: not in this build


def _onednn_op():
    """The op, once it has given F.linear's answer on a small product; False where it is missing or
    does not (then every product takes the MKL paths)."""
    global _onednn
    if _onednn is None:
        _onednn = False
        op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
        if op is not None and torch.backends.mkldnn.is_available():
            x, w = torch.linspace(-1, 1, 48).view(6, 8), torch.linspace(1, -1, 40).view(5, 8)
            b = torch.ones(5)
            try:
                same = torch.allclose(op(x, w, b, "none", [], ""), F.linear(x, w, b), atol=1e-5)
            except RuntimeError:
                same = False
            _onednn = op if same else False
    return _onednn


def row_bucket(m: int) -> int:
    """The ladder size a GEMM of m rows runs at (m >= 1)."""
    if m <= 64:
        return -(-m // 8) * 8
    step = 1 << ((m - 1).bit_length() - 4)
    return -(-m // step) * step


def _onednn_for(x: torch.Tensor):
    """The oneDNN op where it runs this product (CPU, float32, eager, > SMALL_BATCH rows), else None."""
    if x.is_cuda or x.dim() != 2 or x.dtype != torch.float32 or x.shape[0] <= SMALL_BATCH:
        return None
    return None if torch.compiler.is_compiling() else (_onednn_op() or None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [M, K], weight: [N, K] -> [M, N]
    if torch.compiler.is_compiling() and not x.is_cuda:
        return _traced_cpu_linear(x, weight, bias)
    return _eager_linear(x, weight, bias)


def _traced_cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What a compiled CPU step runs: up to GEMV_ROWS rows as a reduction inductor writes itself (one
    pass over the weight, which a GEMM library does not stream at the bandwidth for so few rows), more
    as one opaque call to the eager GEMM paths below (oneDNN's ladder is built for them at boot)."""
    if x.shape[0] <= GEMV_ROWS:
        out = (weight[None] * x[:, None, :]).sum(-1, dtype=torch.float32).to(x.dtype)  # [M, N]
        return out if bias is None else out + bias
    return torch.ops.phaseflip.cpu_linear(x, weight, bias)


def _eager_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    m = x.shape[0]
    op = _onednn_for(x)
    if op is not None:
        rows = row_bucket(m)
        if rows != m:  # zero rows up to the ladder size (F.pad copies even when it adds nothing)
            x = F.pad(x, (0, 0, 0, rows - m))
        return op(x.contiguous(), weight, bias, "none", [], "")[:m]
    if x.is_cuda or x.dim() != 2 or not 1 <= m <= SMALL_BATCH:
        return F.linear(x, weight, bias)
    cols = x.repeat(2, 1) if m == 1 else x                   # [M', K]
    out = torch.mm(weight, cols.t())[:, :m].t().contiguous()   # [M, N]
    return out if bias is None else out.add_(bias)


def _cpu_linear_body(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _eager_linear(x.contiguous(), weight, bias)


def _cpu_linear_fake(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


_cpu_linear_op = define_op("cpu_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", _cpu_linear_body,
                           _cpu_linear_fake)


def warm(projections: Iterable[tuple[torch.Tensor, torch.Tensor | None, int]]) -> int:
    """Run every ladder size up to max_rows once for each distinct (weight shape, bias) of
    `projections` ((weight, bias, max_rows) triples), so that no GEMM is built after boot.
    Returns the number of GEMMs run (0 where oneDNN is not used)."""
    seen: dict[tuple, tuple[torch.Tensor, torch.Tensor | None, int]] = {}
    for w, b, max_rows in projections:
        key = (tuple(w.shape), w.dtype, w.device.type, b is not None)
        if key not in seen or seen[key][2] < max_rows:
            seen[key] = (w, b, max_rows)
    runs = 0
    for w, b, max_rows in seen.values():
        probe = torch.empty(SMALL_BATCH + 1, w.shape[1], dtype=w.dtype)
        if w.device.type != "cpu" or _onednn_for(probe) is None:
            continue
        x = torch.zeros(row_bucket(max_rows), w.shape[1], dtype=w.dtype)
        for rows in sorted({row_bucket(m) for m in range(SMALL_BATCH + 1, max_rows + 1)}):
            linear(x[:rows], w, b)
            runs += 1
    return runs
