"""Dense projections (x @ W^T) on the CPU: the product forms, and which one a product takes.

Owns: `linear` (a CPU product), the forms (`product` runs one by name; `serves` says where it can), the
choices among them (`Forms`, one per weight dtype, kept in one place: `follow` sets them from the boot's
measurements in forms.py, `chosen` reads them, `form` turns them into the form of one product), the row
ladder (`row_bucket`) and `warm` (builds every ladder GEMM at boot).

The forms:
- "kernel": our few-rows kernel (kernels/cpu/gemv.cpp), one pass over the weight at the memory's read
  speed for a few rows, x transposed into panels for more; where it builds.
- "ladder": oneDNN's GEMM (`mkldnn::_linear_pointwise`, what inductor's CPU fusions call; it picks its
  code by the CPU's features where MKL's F.linear runs AVX2 code on AMD CPUs) with rows padded up to a
  ladder of row counts (multiples of 8 to 64, then 8 steps per doubling: padding <= 12.5%), because
  oneDNN JIT-builds and keeps one GEMM per row count: `warm` builds the whole ladder at boot, like a
  graph capture, so that a server fed every row count grows nothing later. float32 only; other dtypes
  take F.linear there.
- "widened": bfloat16 on the float32 ladder, the weight widened a bounded block of rows at a time (on a
  CPU without bf16 arithmetic the library's bf16 GEMM runs slow code).
- "stationary": W @ x^T (one row run as two, so that MKL takes its skinny GEMM rather than its GEMV),
  and "library": F.linear. The few-rows forms the boot times beside the kernel: where it is missing (no
  compiler), or slower (each has won on a machine class: docs/performance.md, CPU products).
- "reduction": the product written as a reduction that inductor compiles itself (a compiled step's
  one-row products, where the boot measured it faster); "opaque": one opaque call to the eager forms
  from a compiled step (`phaseflip::cpu_linear`).
Unmeasured, products take "stationary" up to SMALL_BATCH rows and the ladder above. The weight is used
as it lies in the arena (no packed copy: a flip refills the arena in place).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping

import torch
import torch.nn.functional as F

from phaseflip.kernels.cpu import library, quant
from phaseflip.kernels.op_registry import define_op

GEMV_ROWS = 1     # rows a compiled CPU step may multiply with inductor's own reduction
SMALL_BATCH = 4   # rows up to which the measured few-rows form is used
SMALL_FORMS = ("stationary", "library", "kernel")
MEASURED_ROWS = (1, 2, SMALL_BATCH)   # the row counts timed at boot; 3 takes SMALL_BATCH's form
WIDE_ROWS = (8, 16, 32, 64, 128, 256, 512)   # timed at boot: m rows take the first >= m, else the last
WIDEN_BYTES = 32 * 2**20  # the most float32 weight a widened ladder product holds at once


@dataclass(frozen=True)
class Forms:
    """The forms the products of one weight dtype take in this process (the boot's measurements of the
    last model measured; a rank process holds one model)."""
    small: Mapping[int, str] = field(default_factory=dict)   # MEASURED_ROWS -> one of SMALL_FORMS
    wide: Mapping[int, str] = field(default_factory=dict)    # WIDE_ROWS -> "kernel" | "ladder"
    one_row: str = "reduction"   # a compiled step's <= GEMV_ROWS rows: "reduction", else the small form
    ladder: str = "library"      # bfloat16 above SMALL_BATCH rows off the kernel: "library" | "widened"


_chosen: dict[torch.dtype, Forms] = {}
_onednn = None    # the oneDNN op, resolved on first use (no import-time work); False: not in this build


def chosen(dtype: torch.dtype) -> Forms:
    """The forms dtype's products take (unmeasured: the defaults)."""
    return _chosen.get(dtype) or Forms()


def follow(dtype: torch.dtype, **changes) -> Forms:
    """Make dtype's products take the forms `changes` names (Forms' fields), the others kept."""
    _chosen[dtype] = replace(chosen(dtype), **changes)
    return _chosen[dtype]


def form(m: int, dtype: torch.dtype, traced: bool = False) -> str:
    """The form a product of m rows of dtype takes, eager or (traced) inside a compiled step."""
    forms = chosen(dtype)
    if traced:
        if m <= GEMV_ROWS and forms.one_row == "reduction":   # the one-row graph (its row count is static)
            return "reduction"
        if _kernel_everywhere(forms, dtype):   # no test of m: one graph serves every row count
            return "kernel"
        small = _small(forms, m, dtype) if isinstance(m, int) and 1 <= m <= SMALL_BATCH else None
        return small if small in ("library", "kernel") else "opaque"   # inductor calls those two itself
    if 1 <= m <= SMALL_BATCH:
        return _small(forms, m, dtype)
    wide = forms.wide.get(next((r for r in WIDE_ROWS if r >= m), WIDE_ROWS[-1]))
    if m > SMALL_BATCH and wide == "kernel" and serves("kernel", dtype):
        return "kernel"
    return ladder_form(dtype)


def _kernel_everywhere(forms: Forms, dtype: torch.dtype) -> bool:
    """Whether every row count a compiled step may multiply (above GEMV_ROWS where those reduce) takes
    the kernel: then the traced form does not compare m with SMALL_BATCH, which would make dynamo
    specialise the step's row dimension (a graph for 2 rows, one for 3-4, one above)."""
    rows = [m for m in MEASURED_ROWS if m > GEMV_ROWS or forms.one_row != "reduction"]
    return (all(_small(forms, m, dtype) == "kernel" for m in rows)
            and all(forms.wide.get(r) == "kernel" for r in WIDE_ROWS) and serves("kernel", dtype))


def ladder_form(dtype: torch.dtype) -> str:
    """The ladder's form for dtype: "widened" where the boot measured bf16 faster widened, else "ladder"."""
    return "widened" if chosen(dtype).ladder == "widened" else "ladder"


def _small(forms: Forms, m: int, dtype: torch.dtype) -> str:
    """The measured form of the row count that covers m (1, 2 or SMALL_BATCH), where it serves dtype."""
    name = forms.small.get(1 if m <= 1 else 2 if m == 2 else SMALL_BATCH, "stationary")
    return name if serves(name, dtype) else "stationary"


def serves(name: str, dtype: torch.dtype) -> bool:
    """Whether a form can run for dtype: the kernel where it built and for the dtypes it reads; the
    others always (a name that is no form, e.g. from an older record, never)."""
    if name == "kernel":
        return dtype in library.DTYPES and library.few_rows_op() is not None
    return name in _PRODUCTS


def kernel_serves(weight: torch.Tensor) -> bool:
    """The kernel reads weight rows that are contiguous (the arena's are; a view may not be)."""
    return weight.dim() == 2 and weight.stride(1) == 1 and weight.device.type == "cpu"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) on the CPU, in the form chosen for M rows (a weight in a GGUF
    block format: `quantized`)."""
    if weight.dtype == torch.uint8:
        return quantized(x, weight, bias)
    if x.dim() != 2:
        return F.linear(x, weight, bias)
    return product(form(x.shape[0], x.dtype, torch.compiler.is_compiling()), x, weight, bias)


def product(name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T + bias in the form `name` (module docstring)."""
    return _PRODUCTS[name](x, weight, bias)


def _with_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out + bias


def _reduction(x, weight, bias):
    out = (weight[None] * x[:, None, :]).sum(-1, dtype=torch.float32).to(x.dtype)   # [M, N]
    return _with_bias(out, bias)


def _stationary(x, weight, bias):
    m = x.shape[0]
    cols = x.repeat(2, 1) if m == 1 else x                     # [M', K]
    out = torch.mm(weight, cols.t())[:, :m].t().contiguous()   # [M, N]
    return out if bias is None else out.add_(bias)


def _kernel(x, weight, bias):
    """The few-rows kernel; a weight it cannot read takes the unmeasured form of its row count."""
    if not kernel_serves(weight):
        return product("stationary" if x.shape[0] <= SMALL_BATCH else ladder_form(x.dtype), x, weight, bias)
    if torch.compiler.is_compiling():   # an extern call inductor makes itself
        return _with_bias(library.few_rows_op()(x, weight), bias)
    out = library.few_rows_op()(x, weight)
    return out if bias is None else out.add_(bias)


def _ladder(x, weight, bias):
    """oneDNN on the row ladder where it runs the product (float32, > SMALL_BATCH rows, eager), else
    F.linear."""
    op = _onednn_for(x)
    if op is None:
        return F.linear(x, weight, bias)
    m, rows = x.shape[0], row_bucket(x.shape[0])
    if rows != m:  # zero rows up to the ladder size (F.pad copies even when it adds nothing)
        x = F.pad(x, (0, 0, 0, rows - m))
    return op(x.contiguous(), weight, bias, "none", [], "")[:m]


def _widened(x, weight, bias):
    """x @ weight^T + bias in float32 on the ladder, rounded to x's dtype: the weight widened WIDEN_BYTES
    of rows at a time (a bounded transient: an 8B model's head widened whole would be 2.1 GB)."""
    xf, rows = x.float(), max(1, WIDEN_BYTES // (4 * weight.shape[1]))
    parts = [_ladder(xf, weight[n:n + rows].float(), None if bias is None else bias[n:n + rows].float())
             for n in range(0, weight.shape[0], rows)]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).to(x.dtype)


def quantized(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias), W in a GGUF block format (uint8 [N, blocks, block bytes], quant.py): the
    quantized kernel at every row count (it decodes the blocks in registers for a few rows, into L1
    tiles for more; never the whole weight)."""
    return _with_bias(quant.quant_linear(x, weight.flatten(1), quant.weight_format(weight)), bias)


def _opaque(x, weight, bias):
    return torch.ops.phaseflip.cpu_linear(x, weight, bias)


_PRODUCTS = {"kernel": _kernel, "ladder": _ladder, "widened": _widened, "stationary": _stationary,
             "library": F.linear, "reduction": _reduction, "opaque": _opaque}


def onednn_op():
    """The oneDNN op, once it has given F.linear's answer on a small product; False where it is missing or
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


def _onednn_for(x: torch.Tensor):
    """The oneDNN op where it runs this product (float32, > SMALL_BATCH rows, eager), else None."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.shape[0] <= SMALL_BATCH:
        return None
    return None if torch.compiler.is_compiling() else (onednn_op() or None)


def row_bucket(m: int) -> int:
    """The ladder size a GEMM of m rows runs at (m >= 1)."""
    if m <= 64:
        return -(-m // 8) * 8
    step = 1 << ((m - 1).bit_length() - 4)
    return -(-m // step) * step


def _cpu_linear_body(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    x = x.contiguous()
    return product(form(x.shape[0], x.dtype), x, weight, bias)


define_op("cpu_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", _cpu_linear_body,
          lambda x, weight, bias: x.new_empty((x.shape[0], weight.shape[0])))


def warm(projections: Iterable[tuple[torch.Tensor, torch.Tensor | None, int]]) -> int:
    """Run every ladder size up to max_rows that the products take (`form`: unmeasured, every size
    above SMALL_BATCH; measured, those where the kernel does not serve) once for each distinct
    (weight shape, bias) of `projections` ((weight, bias, max_rows) triples), so that no GEMM is built
    after boot and none is built that no product uses. Returns the number of GEMMs run (0 where oneDNN
    is not used)."""
    seen: dict[tuple, tuple[torch.Tensor, torch.Tensor | None, int]] = {}
    for w, b, max_rows in projections:
        key = (tuple(w.shape), w.dtype, w.device.type, b is not None)
        if key not in seen or seen[key][2] < max_rows:
            seen[key] = (w, b, max_rows)
    runs = 0
    for w, b, max_rows in seen.values():
        ladder = ladder_form(w.dtype)
        probe = torch.empty(SMALL_BATCH + 1, w.shape[1], dtype=torch.float32 if ladder == "widened" else w.dtype)
        if w.device.type != "cpu" or _onednn_for(probe) is None:
            continue
        x = torch.zeros(row_bucket(max_rows), w.shape[1], dtype=w.dtype)
        for rows in sorted({row_bucket(m) for m in range(1, max_rows + 1)}):  # 8 serves the small rows
            if form(rows, w.dtype) == ladder:   # a size's rows all take its form (WIDE_ROWS are sizes)
                product(ladder, x[:rows], w, b)
                runs += 1
    return runs

