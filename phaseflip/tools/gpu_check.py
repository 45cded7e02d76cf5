"""The GPU check: one prepared command that proves and measures the CUDA path on one GPU in minutes.

    PYTHONPATH=. python -m phaseflip.tools.gpu_check --out DIR [--dry-run] [--budget-s S]

Writes DIR/gpu_check.json (rewritten after every section, so a killed run still leaves what it had)
and DIR/gpu_check.log. Sections, in order (each guarded: a failure is recorded with its traceback and
the next one runs; once the time budget is spent the rest are recorded as skipped):
  environment        versions, device
  kernels            every Triton kernel case against its torch reference, plus one CUDA-graph replay
  bandwidth          device memory (a device-to-device copy: 2 bytes of traffic per byte copied) and
                     pinned host-to-device, both timed with CUDA events
  capture            boot of a Llama-3.2-1B-shaped model (random bf16 weights), layouts pp and tp at world
                     size 1, park="always", compile per --engine-compile: capture time per layout and graph
                     pool bytes (from llm.inspect()'s captured steps)
  replay_vs_eager    greedy tokens of the captured engine against enforce_eager=True
  park_restore       10 flips with the arena poisoned before each refill: outputs identical, pointers stable
  restore            refill time against arena bytes / pinned bandwidth
  decode_throughput  decode tokens/s at batch 1, 8, 64 next to the weight-bandwidth bound
  fp32_parity        fp32 greedy tokens of a tiny Llama and a tiny Qwen3-MoE (Triton's grouped experts in the
                     captured steps) against HF transformers
  hf_decode          HF transformers at the same batches (static cache + torch.compile); a batch starts
                     only while it is expected to end within GRACE_S of the budget
  quantized_decode   the 1B shape as GGUF files of random blocks (Q8_0; a Q4_K_M make-up), served by the
                     Triton kernels in the TP layout: batch-1 decode against the read bound of the quantized
                     bytes and against section decode_throughput's bf16
  decode_8b          a Llama-3.1-8B-shaped model (random bf16), TP layout: batch-1 decode against its bound;
                     skipped with the reason when the budget left is too short
  compile_boot       cold and warm boots (fresh processes, fresh then reused inductor/Triton caches) of the
                     1B and 30-layer SmolLM2 shapes with compile="auto": compile seconds, choices, and
                     decode tokens/s against the uncompiled engine
  kv_sizing          the 1B shape booted with gpu_memory_utilization=0.9, the device to itself: the
                     device's used fraction after boot against 0.9, the KV tokens and why, the ledger's
                     negative terms and unexplained bytes against the driver, tokens against section capture's
--sections a,b,...   runs only those (in the order above); a section that needs an earlier one's results
                     records that it did not get them. What one run's budget skipped or left unfinished
                     runs next, e.g. `--sections environment,bandwidth,decode_8b,compile_boot`.
--dry-run runs the same steps on the CPU with tiny shapes (kernels through Triton's interpreter, a
subset; HF without torch.compile), so CI proves the script is wired; its numbers are CPU numbers.
Every number is measured in this run, or null next to the reason: never made up. Needs the source
checkout on PYTHONPATH (tests/models.py builds the tokenizer and the HF references).

The sections live in gpu_sections_device.py (environment, kernels, bandwidth), gpu_sections_engine.py
(the engine and HF sections), gpu_sections_step.py (decode_step), gpu_sections_compile.py (decode_8b,
compile_boot), gpu_sections_memory.py (kv_sizing) and gpu_sections_quant.py (quantized_decode); profiles and the Context they share in
gpu_context.py. This module owns the driver: argument parsing, the section loop with its time budget,
and the JSON and log files.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path

from phaseflip.tools.gpu_context import (DRY, DRY_KERNEL_CASES, FULL, GRACE_S, LLAMA_1B, TINY,  # noqa: F401
                                         Context, Profile)
from phaseflip.tools.gpu_sections_compile import compile_boot, decode_8b
from phaseflip.tools.gpu_sections_device import bandwidth, environment, kernels
from phaseflip.tools.gpu_sections_engine import (capture, decode_throughput, fp32_parity, hf_decode,
                                                 park_restore, replay_vs_eager, restore, write_model)  # noqa: F401
from phaseflip.tools.gpu_sections_memory import kv_sizing
from phaseflip.tools.gpu_sections_quant import quantized_decode
from phaseflip.tools.gpu_sections_step import decode_step

log = logging.getLogger("phaseflip.gpu_check")

SECTIONS = (environment, kernels, bandwidth, capture, replay_vs_eager, park_restore, restore,
            decode_throughput, decode_step, fp32_parity, hf_decode, quantized_decode, decode_8b, compile_boot,
            kv_sizing)


# -- driver ------------------------------------------------------------------------------------------
def run(out: Path, dry_run: bool, budget_s: float, engine_compile: str = "off",
        sections: tuple[str, ...] | None = None) -> dict:
    start = time.monotonic()
    ctx = Context(DRY if dry_run else FULL, dry_run, Path(tempfile.mkdtemp(prefix="gpu_check_")), start + budget_s,
                  engine_compile)
    report = {"gpu_check": 1, "dry_run": dry_run, "budget_s": budget_s, "engine_compile": engine_compile,
              "sections_asked": list(sections) if sections else "all",
              "sections": {}}
    try:
        for section in SECTIONS:
            name = section.__name__
            if sections is not None and name not in sections:
                continue
            if time.monotonic() > ctx.deadline:
                report["sections"][name] = {"ok": None, "skipped": "time budget spent"}
                continue
            t0 = time.monotonic()
            log.info("section %s ...", name)
            try:
                result = section(ctx)
            except Exception as e:  # noqa: BLE001 — recorded; the next section still runs
                log.exception("section %s failed", name)
                result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            result["seconds"] = time.monotonic() - t0
            report["sections"][name] = result
            log.info("section %s: ok=%s in %.1f s", name, result.get("ok"), result["seconds"])
            report["total_s"] = time.monotonic() - start
            _write(out, report)
    finally:
        if "llm" in ctx.shared:
            ctx.shared["llm"].shutdown()
        shutil.rmtree(ctx.work, ignore_errors=True)
    report["ok"] = all(s.get("ok") for s in report["sections"].values())
    report["total_s"] = time.monotonic() - start
    _write(out, report)
    return report


def _write(out: Path, report: dict) -> None:
    tmp = out / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(out / "gpu_check.json")


def _section_names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    known = [s.__name__ for s in SECTIONS]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown section {bad[0] if bad else text!r}: allowed are {', '.join(known)}")
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m phaseflip.tools.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json and gpu_check.log")
    parser.add_argument("--dry-run", action="store_true", help="the same steps on the CPU with tiny shapes")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting sections after this many seconds (default 400; dry run 300)")
    parser.add_argument("--engine-compile", choices=("off", "auto", "on"), default="off",
                        help="the 1B engine's compile option (default off: inductor compiles of a 16-layer "
                             "step per layout and role do not fit the 8-minute check next to HF's)")
    parser.add_argument("--sections", type=_section_names, default=None,
                        help="comma-separated section names to run (default: all, in order)")
    args = parser.parse_args(argv)
    if args.dry_run:   # read when triton is first imported: before anything imports it
        os.environ.setdefault("TRITON_INTERPRET", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    handlers = [logging.FileHandler(args.out / "gpu_check.log", mode="w"), logging.StreamHandler()]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        handlers=handlers, force=True)
    budget = args.budget_s if args.budget_s is not None else (300.0 if args.dry_run else 400.0)
    report = run(args.out, args.dry_run, budget, args.engine_compile, args.sections)
    for name, s in report["sections"].items():
        log.info("%-18s ok=%s %s", name, s.get("ok"), s.get("error") or s.get("skipped") or "")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
