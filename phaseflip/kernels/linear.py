"""Dense projections (x @ W^T) for the model maths on the CPU: oneDNN's GEMM on a ladder of row counts,
and, for a few rows, the form measured fastest on this machine.

Owns: `linear`, the row ladder (`row_bucket`), `warm` (builds every ladder GEMM at boot), and the boot
measurements of the small-rows forms (`choose_small_forms`), of the wide-rows form (`choose_wide_forms`:
the few-rows kernel or the ladder's product, above SMALL_BATCH rows), of a compiled step's
one-row form (`choose_gemv`: inductor's reductions or the eager product, over a pass of the layers) and
of bfloat16's ladder form (`choose_ladder_form`: the library's bf16 product or float32 on oneDNN).

Why: torch's CPU F.linear calls MKL, which on AMD CPUs runs its AVX2 code whatever the CPU offers;
oneDNN (shipped with torch: `mkldnn::_linear_pointwise`, what inductor's CPU fusions call) picks its
kernel by the CPU's features. But oneDNN JIT-builds and keeps one GEMM per row count, so a server fed
every row count grows without bound: rows are padded up to a ladder (multiples of 8 to 64, then 8
steps per doubling: padding <= 12.5%) and `warm` builds all of it at boot, like a graph capture, so
what the GEMMs hold is measured then. For a handful of rows (decode) the fastest product differs from
machine to machine, so it is timed at boot: the library's product (F.linear), the weight-stationary
W @ x^T (one row run as two, so that MKL takes its skinny GEMM rather than its GEMV), oneDNN padded
to its ladder, or our few-rows kernel (kernels/cpu_kernels.py, where it builds); unmeasured, the
stationary form is used. Above SMALL_BATCH rows (batched decode, prompt chunks, the head over a
batch) the kernel's wide form is timed against the ladder's product (`choose_wide_forms`): over
SmolLM2's 30 layers, float32, 2 Zen 3 cores, 8 / 32 / 128 / 256 / 512 rows took 31.8-36.7 / 39 / 146
/ 291 / 612 ms against oneDNN's 46.4-55.5 / 88.9 / 203 / 367 / 693 (~186 GFLOPS of the cores' 199 from
128 rows; 2026-12-02; a Zen 4's AVX-512 timings are in cpu_wide.h); unmeasured, the ladder. The plain
weight is used as it lies in the arena (no packed copy: a flip refills the arena in place). CUDA
tensors take F.linear; traced CPU code: `_traced_cpu_linear`.
"""
from __future__ import annotations

import time
from functools import partial
from typing import Iterable

import torch
import torch.nn.functional as F

from phaseflip.kernels import cpu_kernels
from phaseflip.kernels.op_registry import define_op

GEMV_ROWS = 1     # rows a compiled CPU step may multiply with inductor's own reduction (choose_gemv)
SMALL_BATCH = 4   # rows up to which a measured small-rows form is used on the CPU
SMALL_FORMS = ("stationary", "library", "onednn", "kernel")
MEASURED_ROWS = (1, 2, SMALL_BATCH)   # the row counts timed at boot; 3 takes SMALL_BATCH's form (small_form)
WIDE_ROWS = (8, 16, 32, 64, 128, 256, 512)   # timed at boot: m rows take the first >= m, else the last
WIDE_LAYER_ROWS = 64   # above it, the wide forms are timed on one layer's weights (GEMM-bound: one tells)
LADDER_PROBE_ROWS = 128   # the rows (a prefill chunk) bfloat16's two ladder forms are timed at
WIDEN_BYTES = 32 * 2**20  # the most float32 weight a widened ladder product holds at once

# The measurements the products of each weight dtype follow: the last model measured (absent: not
# measured yet; the defaults apply). Engines alive side by side in one process on different models of a
# dtype share the last one's (the rank processes hold one model each).
_small_reports: dict[torch.dtype, dict] = {}   # the small-rows forms and their timings (choose_small_forms)
_gemv_reports: dict[torch.dtype, dict] = {}    # a compiled step's one-row form (choose_gemv)
_wide_reports: dict[torch.dtype, dict] = {}    # the wide-rows form (choose_wide_forms)
_ladder_reports: dict[torch.dtype, dict] = {}  # bfloat16's ladder form (choose_ladder_form)
# Every measurement of this process by (what, dtype, model): a model's second layout (or engine) takes
# its model's, another model is measured anew. Keyed by dtype alone, a tiny model measured first had
# put SmolLM2's one-row products on the library's product: its batch-1 decode 2x slower (2026-12-03).
_measured: dict[tuple, dict] = {}

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
            out = cpu_kernels.few_rows_op()(x, weight)
            return out if bias is None else out + bias
    return torch.ops.phaseflip.cpu_linear(x, weight, bias)


def _reduce_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (weight[None] * x[:, None, :]).sum(-1, dtype=torch.float32).to(x.dtype)  # [M, N]


def gemv_reduces(dtype: torch.dtype) -> bool:
    """Whether a compiled step's one-row products are inductor's reduction (this process's measured
    choice for the dtype; unmeasured: yes)."""
    report = _gemv_reports.get(dtype)
    return report is None or report["choice"] == "reduction"


def choose_gemv(layers: list[tuple[torch.Tensor, ...]], repeats: int = 3, model=None) -> dict:
    """Measure once per process, dtype and model (_once) whether a compiled step's one-row products are
    faster as inductor's reductions or as the eager product (the measured small-rows form, as the step
    calls it),
    over a pass of every layer's projections (each layer one compiled graph), alternating, best of
    `repeats`. A single weight timed alone misled: on SmolLM2's 113 MB head the forms were within 1%,
    and where eager won by that hair the decode step took 28 ms instead of 18-20 (the pass: reductions
    21 ms, eager 34-45; fp32, 2026-12-01). Call before any step is traced (the choice is read then).
    bfloat16 where the kernel serves takes it without a pass (BF16_KERNEL). Returns the report."""
    dtype, weights = layers[0][0].dtype, [w for layer in layers for w in layer]
    return _once(_gemv_reports, "gemv", dtype, model, weights, partial(_gemv_passes, layers, repeats))


def _gemv_passes(layers: list[tuple[torch.Tensor, ...]], repeats: int) -> dict:
    """choose_gemv's measurement."""
    dtype = layers[0][0].dtype
    pass_bytes = sum(w.numel() * w.element_size() for layer in layers for w in layer)
    if dtype == torch.bfloat16 and small_form(1, dtype) == "kernel":
        return {"choice": "kernel", "ms": None, "first_call_ms": None, "layers": len(layers),
                "pass_bytes": pass_bytes, "reason": BF16_KERNEL}
    xs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=dtype) for layer in layers for w in layer}
    form = small_form(1, dtype)
    passes = {"reduction": torch.compile(partial(_one_row_products, form="reduction"), dynamic=False),
              form: torch.compile(partial(_one_row_products, form=form), dynamic=False)}
    t0 = time.perf_counter()
    for products in passes.values():
        products(xs, layers[0])
    first_ms = (time.perf_counter() - t0) * 1e3
    ms = _alternating_ms({name: lambda p=products: [p(xs, layer) for layer in layers]
                          for name, products in passes.items()}, repeats)
    return {"choice": min(ms, key=ms.get), "ms": ms, "first_call_ms": first_ms,
            "layers": len(layers), "pass_bytes": pass_bytes}


# bf16 takes the kernel untimed: the layer pass picked the reductions in 3 of 14 boots, the served step in none
BF16_KERNEL = ("bfloat16 one-row products take the few-rows kernel unmeasured: the whole decode step "
               "served, the choice forced, alternating boots: kernel 13.6-15.2 and 11.0-12.7 ms/token, "
               "reductions 18.3-19.4 and 16.3-18.0 (SmolLM2 batch 1, 2 cores, 2026-12-02; in float32 the "
               "pass and the step agree: reductions 17.6-21.9, kernel 22.7-26.6)")


def _one_row_products(xs: dict[int, torch.Tensor], weights: tuple[torch.Tensor, ...], form: str) -> list:
    """One row times each weight, as a compiled step computes it in `form` (choose_gemv)."""
    def product(x, w):
        if form == "reduction":
            return _reduce_rows(x, w)
        if form == "kernel" and _kernel_serves(w):
            return cpu_kernels.few_rows_op()(x, w)
        return F.linear(x, w) if form == "library" else torch.ops.phaseflip.cpu_linear(x, w, None)
    return [product(xs[w.shape[1]], w) for w in weights]


def _best_ms(fn, repeats: int) -> float:
    """The best of `repeats` timed calls of fn."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _alternating_ms(runs: dict, rounds: int) -> dict[str, float]:
    """The best ms of each of `runs` (name -> a call of no arguments), the calls taking turns `rounds` times."""
    ms = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, run in runs.items():
            ms[name] = min(ms[name], _best_ms(run, 1))
    return ms


def _once(reports: dict, what: str, dtype: torch.dtype, model, weights: list[torch.Tensor], measure) -> dict:
    """`what`'s report for (dtype, model), measure() on the first call for them; it becomes the one dtype's
    products follow. model: any hashable naming the model (None: the shapes of `weights`)."""
    key = (what, dtype, model if model is not None else tuple(sorted({tuple(w.shape) for w in weights})))
    if key not in _measured:
        _measured[key] = measure()
    reports[dtype] = _measured[key]
    return reports[dtype]


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


def choose_ladder_form(weights: list[torch.Tensor], passes: int = 2, model=None) -> dict:
    """Measure once per process and model (_once) whether bfloat16 products on the ladder run faster as the
    library's bf16 product or widened to float32 on oneDNN's ladder: LADDER_PROBE_ROWS rows times each of
    `weights` (one layer's projections: GEMM-bound, one layer tells), alternating, best of `passes`. On an
    AVX2-only Zen 3 (no bf16 arithmetic) SmolLM2's 30 layers at 128 rows took 1515 ms on the library's
    product, 239 widened (2026-12-02). Call before `warm` (it builds the widened ladder). Returns the report."""
    weights = [w for w in weights if w.device.type == "cpu" and w.dim() == 2]
    if not weights or weights[0].dtype != torch.bfloat16:
        return {"choice": "not measured (only bfloat16 has two ladder forms)", "ms": None}
    if not _onednn_op():
        return {"choice": "library (no oneDNN in this build)", "ms": None}

    def measure() -> dict:
        xs = _rows(LADDER_PROBE_ROWS, weights)
        forms = {"library": lambda x, w: F.linear(x, w), "widened": lambda x, w: _widened_product(x, w, None)}
        ms = _alternating_ms({name: lambda p=product: [p(xs[w.shape[1]], w) for w in weights]
                              for name, product in forms.items()}, passes)
        return {"choice": min(ms, key=ms.get), "ms": ms, "rows": LADDER_PROBE_ROWS, "weights": len(weights)}
    return _once(_ladder_reports, "ladder", torch.bfloat16, model, weights, measure)


def _kernel_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = cpu_kernels.few_rows_op()(x, weight)
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
        return dtype in cpu_kernels.DTYPES and cpu_kernels.few_rows_op() is not None
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


def choose_small_forms(weights: list[torch.Tensor], passes: int = 2, model=None) -> dict:
    """Measure once per process, dtype and model (_once) which form multiplies 1, 2 and SMALL_BATCH rows fastest:
    each form runs over every weight in turn (a step's projections, read as a step reads them), the best of
    `passes` passes. Returns the report: the ms of each form per row count, the choice and what it was
    measured on."""
    weights = [w for w in weights if w.device.type == "cpu" and w.dim() == 2]
    if not weights:
        return {"choice": "stationary (no CPU weights to measure on)", "ms": None}
    dtype = weights[0].dtype
    forms = [f for f in SMALL_FORMS if _form_serves(f, dtype)]

    def measure() -> dict:
        return _forms_report({m: {f: _best_pass_ms(f, _rows(m, weights), weights, passes) for f in forms}
                              for m in MEASURED_ROWS}, weights)
    return _once(_small_reports, "small", dtype, model, weights, measure)


def _rows(m: int, weights: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Random x of m rows for each input width among weights (in their dtype), for a measured pass."""
    return {k: torch.randn(m, k, dtype=weights[0].dtype) for k in {w.shape[1] for w in weights}}


def _forms_report(table: dict[int, dict[str, float]], weights: list[torch.Tensor]) -> dict:
    """A forms measurement's report: the fastest form per row count, the timings (ms per row count
    and form) and what they were measured on."""
    chosen = {m: min(ms, key=ms.get) for m, ms in table.items()}
    return {"choice": ", ".join(f"{m} rows: {f}" for m, f in chosen.items()), "forms": chosen, "ms": table,
            "weights": len(weights), "weight_bytes": sum(w.numel() * w.element_size() for w in weights),
            "dtype": str(weights[0].dtype)}


def _best_pass_ms(form: str, xs: dict[int, torch.Tensor], weights: list[torch.Tensor], passes: int) -> float:
    def one_pass():
        for w in weights:
            _small_product(form, xs[w.shape[1]], w, None)
    return _best_ms(one_pass, passes)


def wide_form(m: int, dtype: torch.dtype) -> str:
    """The form a product of m > SMALL_BATCH rows takes: "kernel" where this process measured the kernel
    faster at the smallest timed row count >= m (WIDE_ROWS; past them, the largest), else "ladder"."""
    report = _wide_reports.get(dtype)
    if report is None or m <= SMALL_BATCH or not _form_serves("kernel", dtype):
        return "ladder"
    return report["forms"].get(next((r for r in WIDE_ROWS if r >= m), WIDE_ROWS[-1]), "ladder")


def choose_wide_forms(weights: list[torch.Tensor], passes: int = 2, model=None) -> dict:
    """Measure once per process, dtype and model (_once) whether products of more than SMALL_BATCH rows
    run faster on the few-rows kernel (x transposed, each weight value broadcast over 16 rows of x) or on the
    ladder's product (oneDNN in float32, the library's in bfloat16): at each of WIDE_ROWS, the two
    over every weight in turn (above WIDE_LAYER_ROWS the first layer's four: ~40 / ~80 ms a pass at
    256 / 512 rows, ~1.4 / 2.8 s over SmolLM2's 30), alternating, best of `passes`. Returns the report."""
    weights = [w for w in weights if w.device.type == "cpu" and w.dim() == 2 and _kernel_serves(w)]
    if not weights:
        return {"choice": "ladder (no CPU weights to measure on)", "forms": {}, "ms": None}
    dtype = weights[0].dtype
    if not _form_serves("kernel", dtype):
        return {"choice": f"ladder (no few-rows kernel: {cpu_kernels.kernel_report().get('reason')})",
                "forms": {}, "ms": None}
    products = {"kernel": _kernel_product, "ladder": _ladder_product}

    def measure() -> dict:
        table = {}
        for m in WIDE_ROWS:
            xs, timed = _rows(m, weights), weights if m <= WIDE_LAYER_ROWS else weights[:4]
            table[m] = _alternating_ms({name: lambda p=product: [p(xs[w.shape[1]], w, None) for w in timed]
                                        for name, product in products.items()}, passes)
        return {**_forms_report(table, weights), "one_layer_above_rows": WIDE_LAYER_ROWS}
    return _once(_wide_reports, "wide", dtype, model, weights, measure)


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
