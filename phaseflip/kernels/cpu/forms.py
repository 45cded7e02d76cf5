"""Which product form serves each row count on this machine: the boot's measurements behind
kernels/cpu/linear.py's choices, each made once per process, dtype and model.

Owns: `choose_small_forms` (1, 2 and SMALL_BATCH rows: the library's product, the weight-stationary
one or the few-rows kernel), `choose_wide_forms` (more rows: the kernel's
wide form or the ladder's product), `choose_gemv` (a compiled step's one-row products: inductor's
reductions or the eager product, over a pass of the layers), `choose_ladder_form` (bfloat16 on the
ladder: the library's bf16 product or float32 on oneDNN), `choose_block_rows` (products on GGUF blocks:
up to which rows the few-rows dots, past them the wide integer tile) and `_measured`, every report of this process
by (what, dtype, model); each takes `recorded`, the report an earlier boot measured, in place of
measuring (rank/boot_record.py). Each choice makes the dtype's products follow its report
(linear.follow; quant.set_few_rows for the blocks): the last model measured.
"""
from __future__ import annotations

import time
from functools import partial

import torch

from phaseflip.kernels.cpu import library, quant
from phaseflip.kernels.cpu import linear as lin

# a form other than the few-rows kernel is chosen only where measured this much faster: the kernel
# serves every row count, and where every row count takes it a compiled step tests no row count (one
# graph per role, linear._kernel_everywhere) and calls it directly; timings closer than this differ
# from boot to boot (the other rank compiling beside the measurement)
KERNEL_MARGIN = 0.10
WIDE_LAYER_ROWS = 64   # above it, the wide forms are timed on one layer's weights (GEMM-bound: one tells)
LADDER_PROBE_ROWS = 128   # the rows (a prefill chunk) bfloat16's two ladder forms are timed at

# Every measurement of this process by (what, dtype, model): a model's second layout (or engine) takes
# its model's, another model is measured anew. Keyed by dtype alone, a tiny model measured first would
# choose a larger model's forms, which can make the larger one's batch-1 decode far slower.
_measured: dict[tuple, dict] = {}


def choose_gemv(layers: list[tuple[torch.Tensor, ...]], repeats: int = 3, model=None,
                recorded: dict | None = None) -> dict:
    """Measure once per process, dtype and model (_once) whether a compiled step's one-row products are
    faster as inductor's reductions or as the eager product (the measured small-rows form, as the step
    calls it),
    over a pass of every layer's projections (each layer one compiled graph), alternating, best of
    `repeats`. A single weight timed alone misleads: on a large head (SmolLM2's, 113 MB) the forms time
    within 1%, and the one that wins by that hair can make the decode step far slower, where the pass
    over the layers tells them apart. Call before any step is traced (the choice is read then).
    bfloat16 where the kernel serves takes it without a pass (BF16_KERNEL). Returns the report."""
    dtype, weights = layers[0][0].dtype, [w for layer in layers for w in layer]
    report = _once("gemv", dtype, model, weights, partial(_gemv_passes, layers, repeats), recorded)
    lin.follow(dtype, one_row=report["choice"])
    return report


def _gemv_passes(layers: list[tuple[torch.Tensor, ...]], repeats: int) -> dict:
    """choose_gemv's measurement."""
    dtype = layers[0][0].dtype
    pass_bytes = sum(w.numel() * w.element_size() for layer in layers for w in layer)
    form = lin.form(1, dtype)
    if dtype == torch.bfloat16 and form == "kernel":
        return {"choice": "kernel", "ms": None, "first_call_ms": None, "layers": len(layers),
                "pass_bytes": pass_bytes, "reason": BF16_KERNEL}
    xs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=dtype) for layer in layers for w in layer}
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


# bf16 takes the kernel untimed: the layer pass sometimes picks the reductions, the served step never does
BF16_KERNEL = ("bfloat16 one-row products take the few-rows kernel unmeasured: served in the whole decode "
               "step it is faster than inductor's reductions, which the one-layer pass does not show "
               "(docs/performance.md, CPU products)")


def _one_row_products(xs: dict[int, torch.Tensor], weights: tuple[torch.Tensor, ...], form: str) -> list:
    """One row times each weight, as a compiled step computes it in `form` (choose_gemv)."""
    traced = form if form in ("reduction", "library", "kernel") else "opaque"   # as linear.form(traced=True)
    return [lin.product(traced, xs[w.shape[1]], w, None) for w in weights]


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


def _once(what: str, dtype: torch.dtype, model, weights: list[torch.Tensor], measure,
          recorded: dict | None = None) -> dict:
    """`what`'s report for (dtype, model), measure() on the first call for them (or `recorded`, a report an
    earlier boot measured: rank/boot_record.py). model: any hashable naming the model (None: the shapes
    of `weights`)."""
    key = (what, dtype, model if model is not None else tuple(sorted({tuple(w.shape) for w in weights})))
    if recorded is not None:
        _measured[key] = recorded
    elif key not in _measured:
        _measured[key] = measure()
    return _measured[key]


def choose_ladder_form(weights: list[torch.Tensor], passes: int = 2, model=None,
                       recorded: dict | None = None) -> dict:
    """Measure once per process and model (_once) whether bfloat16 products on the ladder run faster as the
    library's bf16 product or widened to float32 on oneDNN's ladder: LADDER_PROBE_ROWS rows times each of
    `weights` (one layer's projections: GEMM-bound, one layer tells), alternating, best of `passes`. On a
    CPU without bf16 arithmetic the library's bf16 product is several times slower than the widened one.
    Call before `warm` (it builds the widened ladder). Returns the report."""
    weights = [w for w in weights if w.device.type == "cpu" and w.dim() == 2]
    if not weights or weights[0].dtype != torch.bfloat16:
        return {"choice": "not measured (only bfloat16 has two ladder forms)", "ms": None}
    if not lin.onednn_op():
        return {"choice": "library (no oneDNN in this build)", "ms": None}

    def measure() -> dict:
        xs = _rows(LADDER_PROBE_ROWS, weights)
        ms = _alternating_ms({name: lambda name=name: [lin.product(name, xs[w.shape[1]], w, None) for w in weights]
                              for name in ("library", "widened")}, passes)
        return {"choice": min(ms, key=ms.get), "ms": ms, "rows": LADDER_PROBE_ROWS, "weights": len(weights)}
    report = _once("ladder", torch.bfloat16, model, weights, measure, recorded)
    lin.follow(torch.bfloat16, ladder=report["choice"])
    return report


def choose_small_forms(weights: list[torch.Tensor], passes: int = 2, model=None,
                       recorded: dict | None = None) -> dict:
    """Measure once per process, dtype and model (_once) which form multiplies 1, 2 and SMALL_BATCH rows fastest:
    each form runs over every weight in turn (a step's projections, read as a step reads them), the best of
    `passes` passes. Returns the report: the ms of each form per row count, the choice and what it was
    measured on."""
    weights = [w for w in weights if w.device.type == "cpu" and w.dim() == 2]
    if not weights:
        return {"choice": "stationary (no CPU weights to measure on)", "ms": None}
    dtype = weights[0].dtype
    forms = [f for f in lin.SMALL_FORMS if lin.serves(f, dtype)]

    def measure() -> dict:
        return _forms_report({m: {f: _best_pass_ms(f, _rows(m, weights), weights, passes) for f in forms}
                              for m in lin.MEASURED_ROWS}, weights)
    report = _once("small", dtype, model, weights, measure, recorded)
    lin.follow(dtype, small=report["forms"])
    return report


def _rows(m: int, weights: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Random x of m rows for each input width among weights (in their dtype), for a measured pass."""
    return {k: torch.randn(m, k, dtype=weights[0].dtype) for k in {w.shape[1] for w in weights}}


def _forms_report(table: dict[int, dict[str, float]], weights: list[torch.Tensor]) -> dict:
    """A forms measurement's report: the fastest form per row count, the timings (ms per row count
    and form) and what they were measured on."""
    chosen = {m: _fastest(ms) for m, ms in table.items()}
    return {"choice": ", ".join(f"{m} rows: {f}" for m, f in chosen.items()), "forms": chosen, "ms": table,
            "rule": f"the fastest; the kernel unless another form is >= {KERNEL_MARGIN:.0%} faster",
            "weights": len(weights), "weight_bytes": sum(w.numel() * w.element_size() for w in weights),
            "dtype": str(weights[0].dtype)}


def _fastest(ms: dict[str, float]) -> str:
    """The form measured fastest, the kernel where no other is KERNEL_MARGIN faster."""
    best = min(ms, key=ms.get)
    return "kernel" if "kernel" in ms and ms["kernel"] * (1 - KERNEL_MARGIN) <= ms[best] else best


def _best_pass_ms(form: str, xs: dict[int, torch.Tensor], weights: list[torch.Tensor], passes: int) -> float:
    def one_pass():
        for w in weights:
            lin.product(form, xs[w.shape[1]], w, None)
    return _best_ms(one_pass, passes)


def choose_wide_forms(weights: list[torch.Tensor], passes: int = 2, model=None,
                      recorded: dict | None = None) -> dict:
    """Measure once per process, dtype and model (_once) whether products of more than SMALL_BATCH rows
    run faster on the few-rows kernel (x transposed, each weight value broadcast over 16 rows of x) or on the
    ladder's product (oneDNN in float32, the library's in bfloat16): at each of lin.WIDE_ROWS, the two
    over every weight in turn (above WIDE_LAYER_ROWS the first layer's four: a pass over every layer
    would take seconds of boot at 256 and 512 rows), alternating, best of `passes`. Returns the report."""
    weights = [w for w in weights if w.device.type == "cpu" and w.dim() == 2 and lin.kernel_serves(w)]
    if not weights:
        return {"choice": "ladder (no CPU weights to measure on)", "forms": {}, "ms": None}
    dtype = weights[0].dtype
    if not lin.serves("kernel", dtype):
        return {"choice": f"ladder (no few-rows kernel: {library.kernel_report().get('reason')})",
                "forms": {}, "ms": None}
    runs = {"kernel": "kernel", "ladder": lin.ladder_form(dtype)}

    def measure() -> dict:
        table = {}
        for m in lin.WIDE_ROWS:
            xs, timed = _rows(m, weights), weights if m <= WIDE_LAYER_ROWS else weights[:4]
            table[m] = _alternating_ms({name: lambda form=form: [lin.product(form, xs[w.shape[1]], w, None)
                                                               for w in timed]
                                        for name, form in runs.items()}, passes)
        return {**_forms_report(table, weights), "one_layer_above_rows": WIDE_LAYER_ROWS}
    report = _once("wide", dtype, model, weights, measure, recorded)
    lin.follow(dtype, wide=report["forms"])
    return report


BLOCK_ROWS = (9, 12, 16, 24, 32, 48)   # the rows past the few-rows kernel's 8 at which choose_block_rows times


def choose_block_rows(weights: list[torch.Tensor], dtype: torch.dtype, passes: int = 3, model=None,
                      recorded: dict | None = None) -> dict:
    """Measure once per process, dtype and model (_once) up to which rows of x of `dtype` the products on
    each GGUF block format among `weights` (one layer's quantized weights, read as a step reads them) take
    the few-rows dots, in passes of 8 rows that each read the weights again, rather than the wide integer
    tile (kernels/cpu/few_rows.h): at each of BLOCK_ROWS the two forms over that format's weights,
    alternating, best of `passes`. A format's limit is the last of the row counts, from the first on, at
    which the dots are faster (8 where they are not at the first); CPUs with the same instruction set
    disagree on it (docs/performance.md). Only products that take int8 x (quant.int8_x) have the two forms.
    Sets each limit (quant.set_few_rows) and returns the report."""
    by_format: dict[str, list[torch.Tensor]] = {}
    for w in weights if quant.int8_x() else ():
        fmt = quant.weight_format(w)
        if fmt is not None:
            by_format.setdefault(fmt.name, []).append(w.flatten(1))
    if not by_format:
        return {"choice": "not measured (no block products with int8 x)", "limits": {}, "ms": None}

    def measure() -> dict:
        ms = {name: _block_rows_ms(quant.FORMATS[name], ws, dtype, passes) for name, ws in by_format.items()}
        limits = {name: _dots_limit(table) for name, table in ms.items()}
        return {"choice": ", ".join(f"{name}: dots up to {rows} rows" for name, rows in limits.items()),
                "limits": limits, "ms": ms, "rule": "the dots up to the last row count of the run, from the "
                "first on, at which they are faster", "weights": sum(len(ws) for ws in by_format.values())}
    report = _once("block_rows", dtype, model, weights, measure, recorded)
    for name, rows in report["limits"].items():
        quant.set_few_rows(quant.FORMATS[name], rows)
    return report


def _block_rows_ms(fmt: quant.BlockFormat, weights: list[torch.Tensor], dtype: torch.dtype, passes: int) -> dict:
    """choose_block_rows' timings of one format: rows -> {"dots": ms, "wide": ms} over its weights (each
    form warmed first: the wide tile's buffers are made on a thread's first call)."""
    def values(w: torch.Tensor) -> int:
        return w.shape[1] // fmt.block_bytes * fmt.block_values

    def products(limit: int, xs: dict[int, torch.Tensor]) -> None:
        quant.set_few_rows(fmt, limit)
        for w in weights:
            quant.quant_linear(xs[values(w)], w, fmt)
    table = {}
    try:
        for m in BLOCK_ROWS:
            xs = {k: torch.randn(m, k, dtype=dtype) for k in {values(w) for w in weights}}
            runs = {"dots": partial(products, max(BLOCK_ROWS), xs), "wide": partial(products, quant.FEW_ROWS, xs)}
            for run in runs.values():
                run()
            table[m] = _alternating_ms(runs, passes)
    finally:
        quant.set_few_rows(fmt, None)
    return table


def _dots_limit(table: dict[int, dict[str, float]]) -> int:
    """The rows up to which the dots serve: the last row count of the run from the first at which they were
    measured faster than the wide tile (quant.FEW_ROWS where the first was not)."""
    limit = quant.FEW_ROWS
    for m in sorted(table):
        if table[m]["dots"] >= table[m]["wide"]:
            break
        limit = m
    return limit
