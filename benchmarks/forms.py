"""The CPU product forms side by side on this machine (a benchmark, not a test: `make test` never runs it).

Owns: timing every product form the boot chooses among (kernels/cpu/linear.py) on a model's projection
weights as the arena holds them (per layer q|k|v, o, gate|up, down), at the row counts the boot measures:
the few-rows forms at 1, 2 and 4 rows, the kernel's wide form against the ladder's at linear.WIDE_ROWS,
and bfloat16's two ladder forms (the library's product, widened to float32 on oneDNN) at 128 rows. Each
round times the forms in turn over every weight (a step's pass), best of two passes; the table gives each
form's median over rounds, the winner of each row and its margin over the runner-up. A form is kept where
it wins by >= 5% on a machine class the project runs on (issue 43): this prints the rows of this machine.
Not covered: a compiled step's one-row products as inductor's reductions (that choice needs a compiled
pass; the boot record's "gemv" report holds its numbers).

Run: .venv/bin/python benchmarks/forms.py [--model DIR] [--rounds 5] [--threads 2] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from phaseflip.kernels.cpu import library, linear as lin

MARGIN = 0.05   # a form is kept where it wins by at least this


def projections(model_dir: Path, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every layer's projection weights as the arena lays them out (fused q|k|v and gate|up), contiguous."""
    t = load_file(str(model_dir / "model.safetensors"))
    layers = sorted({int(k.split(".")[2]) for k in t if k.startswith("model.layers.")})
    out = []
    for i in layers:
        p = f"model.layers.{i}."
        parts = ([p + f"self_attn.{n}_proj.weight" for n in "qkv"], [p + "self_attn.o_proj.weight"],
                 [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], [p + "mlp.down_proj.weight"])
        out += [torch.cat([t[n] for n in names]).to(dtype).contiguous() for names in parts]
    return out


def pass_ms(form: str, m: int, weights: list[torch.Tensor]) -> float:
    """Best of two passes of `form` with m rows over every weight, in ms."""
    xs = {k: torch.randn(m, k, dtype=weights[0].dtype) for k in {w.shape[1] for w in weights}}
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        for w in weights:
            lin.product(form, xs[w.shape[1]], w, None)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def contests(dtype: torch.dtype) -> list[tuple[int, tuple[str, ...]]]:
    """(rows, the forms the boot chooses among at that row count) for dtype."""
    small = tuple(f for f in lin.SMALL_FORMS if lin.serves(f, dtype))
    ladder = ("ladder",) if dtype == torch.float32 else ("library", "widened")
    wide = tuple(f for f in ("kernel", *ladder) if lin.serves(f, dtype))
    rows = [(m, small) for m in lin.MEASURED_ROWS] + [(m, wide) for m in lin.WIDE_ROWS]
    return rows


def measure(weights: list[torch.Tensor], rounds: int) -> dict:
    """{rows: {form: [ms per round]}}, the forms of a row count taking turns within each round."""
    table = {m: {f: [] for f in forms} for m, forms in contests(weights[0].dtype)}
    for r in range(rounds):
        for m, forms in table.items():
            timed = weights if m <= 64 else weights[:4]   # above 64 rows one layer (GEMM-bound: one tells)
            order = list(forms) if r % 2 == 0 else list(reversed(list(forms)))
            for f in order:
                forms[f].append(pass_ms(f, m, timed))
    return table


def rows_of(dtype: str, table: dict) -> list[dict]:
    out = []
    for m, forms in table.items():
        med = {f: statistics.median(v) for f, v in forms.items()}
        ranked = sorted(med, key=med.get)
        margin = med[ranked[1]] / med[ranked[0]] - 1 if len(ranked) > 1 else None
        out.append({"dtype": dtype, "rows": m, "ms": med, "winner": ranked[0], "margin": margin,
                    "keeps": margin is not None and margin >= MARGIN})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.model is None:
        from phaseflip.engine.checkpoint.default_model import ensure_default_model
        a.model = ensure_default_model()
    library.few_rows_op()   # built or loaded now, so the report below says which
    flags = Path("/proc/cpuinfo").read_text().split()
    isa = "AVX512-BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags else \
        "AVX2" if "avx2" in flags else "no AVX2"
    print(f"# {isa}, {a.threads} threads, torch {torch.__version__}, kernels: "
          f"{library.kernel_report()['available'] or library.kernel_report()['reason']}"
          f" ({time.strftime('%Y-%m-%d %H:%M')})")
    results = []
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        lin.warm((w, None, 512) for w in projections(a.model, dtype)[:4])   # the ladder's GEMMs built first
        results += rows_of(name, measure(projections(a.model, dtype), a.rounds))
    print("| dtype | rows | " + " | ".join(("form ms",) * 3) + " | winner | margin |")
    print("|---|---:|---|---|---|---|---:|")
    for r in results:
        cells = [f"{f} {ms:.2f}" for f, ms in r["ms"].items()] + [""] * (3 - len(r["ms"]))
        mark = "" if r["keeps"] else " (< 5%)"
        print(f"| {r['dtype']} | {r['rows']} | " + " | ".join(cells) + f" | {r['winner']} | "
              f"{r['margin'] * 100:.1f}%{mark} |")
    kept = sorted({(r["dtype"], r["winner"]) for r in results if r["keeps"]})
    print("forms that win by >= 5% somewhere here:", ", ".join(f"{d} {f}" for d, f in kept))
    if a.json:
        a.json.write_text(json.dumps({"isa": isa, "rows": results}, indent=2))


if __name__ == "__main__":
    main()
