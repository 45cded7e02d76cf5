"""Dense projections (x @ W^T) for the model maths on the CPU: oneDNN's GEMM on a ladder of row counts,
and, for a few rows, the form measured fastest on this machine.

Owns: `linear`, the row ladder (`row_bucket`), `warm` (builds every ladder GEMM at boot), each product
form, and which form a product takes (`small_form`, `wide_form`, `gemv_reduces`, `ladder_widens`),
read from the reports the boot's measurements left for the dtype (kernels/cpu/forms.py: the
small-rows forms, the wide-rows form, a compiled step's one-row form and bfloat16's ladder form).

Why: torch's CPU F.linear calls MKL, which on AMD CPUs runs its AVX2 code whatever the CPU offers;
oneDNN (shipped with torch: `mkldnn::_linear_pointwise`, what inductor's CPU fusions call) picks its
kernel by the CPU's features. But oneDNN JIT-builds and keeps one GEMM per row count, so a server fed
every row count grows without bound: rows are padded up to a ladder (multiples of 8 to 64, then 8
steps per doubling: padding <= 12.5%) and `warm` builds all of it at boot, like a graph capture, so
what the GEMMs hold is measured then. For a handful of rows (decode) the fastest product differs from
machine to machine, so it is timed at boot: the library's product (F.linear), the weight-stationary
W @ x^T (one row run as two, so that MKL takes its skinny GEMM rather than its GEMV), oneDNN padded
to its ladder, or our few-rows kernel (kernels/cpu/library.py, where it builds); unmeasured, the
stationary form is used. Above SMALL_BATCH rows (batched decode, prompt chunks, the head over a
batch) the kernel's wide form is timed against the ladder's product (`choose_wide_forms`; on the
machines in docs/performance.md the kernel is the faster at most row counts, near the cores' peak from
128 rows); unmeasured, the ladder. The plain
weight is used as it lies in the arena (no packed copy: a flip refills the arena in place). CUDA
tensors take F.linear; traced CPU code: `_traced_cpu_linear`.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F

from phaseflip.kernels.cpu import library
from phaseflip.kernels.op_registry import define_op

GEMV_ROWS = 1     # rows a compiled CPU step may multiply with inductor's own reduction (choose_gemv)
SMALL_BATCH = 4   # rows up to which a measured small-rows form is used on the CPU
SMALL_FORMS = ("stationary", "library", "onednn", "kernel")
MEASURED_ROWS = (1, 2, SMALL_BATCH)   # the row counts timed at boot; 3 takes SMALL_BATCH's form (small_form)
WIDE_ROWS = (8, 16, 32, 64, 128, 256, 512)   # timed at boot: m rows take the first >= m, else the last
WIDEN_BYTES = 32 * 2**20  # the most float32 weight a widened ladder product holds at once

# The measurements the products of each weight dtype follow: the last model measured (absent: not
# measured yet; the defaults apply). Engines alive side by side in one process on different models of a
# dtype share the last one's (the rank processes hold one model each).
_small_reports: dict[torch.dtype, dict] = {}   # the small-rows forms and their timings (choose_small_forms)
_gemv_reports: dict[torch.dtype, dict] = {}    # a compiled step's one-row form (choose_gemv)
_wide_reports: dict[torch.dtype, dict] = {}    # the wide-rows form (choose_wide_forms)
_ladder_reports: dict[torch.dtype, dict] = {}  # bfloat16's ladder form (choose_ladder_form)

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
    """What a compiled CPU step runs: up to GEMV_ROWS rows as a reduction inductor writes itself where
    that was measured faster than the eager product (`choose_gemv`); a few (static) rows whose
    measured small-rows form is the library's product or the few-rows kernel as that call, which
    inductor makes itself (no Python between the projections); everything else as one opaque call to
    the eager paths below (oneDNN's ladder is built at boot)."""
    m = x.shape[0]
    if m <= GEMV_ROWS and gemv_reduces(x.dtype):  # the one-row graph (its row count is static)
        out = _reduce_rows(x, weight)
        return out if bias is None else out + bias
    if isinstance(m, int) and 1 <= m <= SMALL_BATCH:
        form = small_form(m, x.dtype)
        if form == "library":  # inductor calls the library's product itself
            return F.linear(x, weight, bias)
        if form == "kernel" and _kernel_serves(weight):  # an extern call to the C++ op
            out = library.few_rows_op()(x, weight)
            return out if bias is None else out + bias
    return torch.ops.phaseflip.cpu_linear(x, weight, bias)


def _reduce_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (weight[None] * x[:, None, :]).sum(-1, dtype=torch.float32).to(x.dtype)  # [M, N]


def gemv_reduces(dtype: torch.dtype) -> bool:
    """Whether a compiled step's one-row products are inductor's reduction (this process's measured
    choice for the dtype; unmeasured: yes)."""
    report = _gemv_reports.get(dtype)
    return report is None or report["choice"] == "reduction"


def _eager_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    m = x.shape[0]
    if not x.is_cuda and x.dim() == 2:
        if 1 <= m <= SMALL_BATCH:
            return _small_product(small_form(m, x.dtype), x, weight, bias)
        if wide_form(m, x.dtype) == "kernel" and _kernel_serves(weight):
            return _kernel_product(x, weight, bias)
    return _ladder_product(x, weight, bias)


def _ladder_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN on the row ladder where it runs the product (float32 CPU, > SMALL_BATCH rows; bfloat16
    widened to float32 where that was measured faster), else F.linear."""
    if ladder_widens(x.dtype) and not x.is_cuda:
        return _widened_product(x, weight, bias)
    op = _onednn_for(x)
    if op is None:
        return F.linear(x, weight, bias)
    m, rows = x.shape[0], row_bucket(x.shape[0])
    if rows != m:  # zero rows up to the ladder size (F.pad copies even when it adds nothing)
        x = F.pad(x, (0, 0, 0, rows - m))
    return op(x.contiguous(), weight, bias, "none", [], "")[:m]


def _widened_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T + bias in float32 on the ladder, rounded to x's dtype: the weight widened WIDEN_BYTES
    of rows at a time (a bounded transient: an 8B model's head widened whole would be 2.1 GB)."""
    xf, rows = x.float(), max(1, WIDEN_BYTES // (4 * weight.shape[1]))
    parts = [_ladder_product(xf, weight[n:n + rows].float(), None if bias is None else bias[n:n + rows].float())
             for n in range(0, weight.shape[0], rows)]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).to(x.dtype)


def ladder_widens(dtype: torch.dtype) -> bool:
    """Whether this process measured dtype's ladder products faster widened to float32 (choose_ladder_form)."""
    return _ladder_reports.get(dtype, {}).get("choice") == "widened"


def _kernel_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = library.few_rows_op()(x, weight)
    return out if bias is None else out.add_(bias)


def small_form(m: int, dtype: torch.dtype) -> str:
    """The form a product of m <= SMALL_BATCH rows takes: this process's measured choice, else the
    stationary one; oneDNN only for float32 (its ladder is built for that alone)."""
    rows = 1 if m <= 1 else 2 if m == 2 else SMALL_BATCH     # the measured row count that covers m
    report = _small_reports.get(dtype)
    form = "stationary" if report is None else report["forms"][rows]
    return form if _form_serves(form, dtype) else "stationary"


def _form_serves(form: str, dtype: torch.dtype) -> bool:
    """Whether a small-rows form can run for dtype: oneDNN where this build has the op and for float32
    alone (its ladder is built for that); the kernel where it built and for the dtypes it reads."""
    if form == "onednn":
        return dtype == torch.float32 and bool(_onednn_op())
    if form == "kernel":
        return dtype in library.DTYPES and library.few_rows_op() is not None
    return True


def _kernel_serves(weight: torch.Tensor) -> bool:
    """The kernel reads weight rows that are contiguous (the arena's are; a view may not be)."""
    return weight.dim() == 2 and weight.stride(1) == 1 and weight.device.type == "cpu"


def _small_product(form: str, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    m = x.shape[0]
    if form == "library":
        return F.linear(x, weight, bias)
    if form == "onednn":  # padded to the ladder's smallest size, whose GEMM `warm` built
        return _onednn_op()(F.pad(x, (0, 0, 0, row_bucket(m) - m)), weight, bias, "none", [], "")[:m]
    if form == "kernel" and _kernel_serves(weight):
        return _kernel_product(x, weight, bias)
    cols = x.repeat(2, 1) if m == 1 else x                   # [M', K]
    out = torch.mm(weight, cols.t())[:, :m].t().contiguous()   # [M, N]
    return out if bias is None else out.add_(bias)


def wide_form(m: int, dtype: torch.dtype) -> str:
    """The form a product of m > SMALL_BATCH rows takes: "kernel" where this process measured the kernel
    faster at the smallest timed row count >= m (WIDE_ROWS; past them, the largest), else "ladder"."""
    report = _wide_reports.get(dtype)
    if report is None or m <= SMALL_BATCH or not _form_serves("kernel", dtype):
        return "ladder"
    return report["forms"].get(next((r for r in WIDE_ROWS if r >= m), WIDE_ROWS[-1]), "ladder")


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
        on_ladder = torch.float32 if ladder_widens(w.dtype) else w.dtype   # the dtype oneDNN would run
        probe = torch.empty(SMALL_BATCH + 1, w.shape[1], dtype=on_ladder)
        if w.device.type != "cpu" or _onednn_for(probe) is None:
            continue
        x = torch.zeros(row_bucket(max_rows), w.shape[1], dtype=w.dtype)
        for rows in sorted({row_bucket(m) for m in range(1, max_rows + 1)}):  # 8 serves the small rows
            _ladder_product(x[:rows], w, b)
            runs += 1
    return runs
