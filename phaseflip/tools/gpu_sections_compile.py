"""The GPU check's decode_8b and compile_boot sections: the two that need engines of their own.

Owns: `decode_8b` (a Llama-3.1-8B-shaped model with random bf16 weights, drawn on the device and written
once, booted in the TP layout alone: batch-1 decode tokens/s against the weight-bandwidth bound, target
>= 75%) and `compile_boot` (for the Llama-3.2-1B shape and the 30-layer SmolLM2 shape, both layouts at
world size 1: a cold boot on empty inductor and Triton caches, then a warm boot, a second process on the
same caches, each with the profile's compile mode; compile seconds per boot, the compile report's choice
per layout and role, and decode tokens/s at the bench batches against the uncompiled engine's. Targets:
cold <= 30 s, warm <= 5 s, compiled >= 1.15x uncompiled at batch 1 and never slower). Each boot of
compile_boot runs in its own process (`python -m phaseflip.tools.gpu_sections_compile SPEC`), so warm
means what a user's second boot gets: what is on disk, nothing in memory. A boot that does not finish
within the check's remaining time is recorded as unfinished with that reason, never as a number. The dry
run proves the wiring on the CPU with tiny shapes and compile="off".
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from phaseflip.cache import cache_dir
from phaseflip.tools.gpu_context import GRACE_S, Context

BIG_NEEDS_S = 150.0   # decode_8b on an H200: writing 16 GB of weights, boot, 128 tokens (estimated)
CHILD_MARK = "gpu_check_child: "
TARGETS = {"cold_compile_s": "<= 30", "warm_compile_s": "<= 5", "speedup_batch_1": ">= 1.15",
           "speedup_every_kept_bucket": ">= 1.0"}


def decode_8b(ctx: Context) -> dict:
    from phaseflip import LLM
    from phaseflip.tools.gpu_sections_engine import decode_rates, engine_kwargs, write_model
    p, left = ctx.profile, ctx.deadline - time.monotonic()
    if not ctx.dry_run and left < BIG_NEEDS_S:
        return {"ok": None, "skipped": f"needs about {BIG_NEEDS_S:.0f} s; {left:.0f} s of the budget left"}
    if "llm" in ctx.shared:
        ctx.shared.pop("llm").shutdown()   # the device for the big model alone
    t0 = time.perf_counter()
    model_dir = write_model(ctx.work / "llama-8b-shape", p.big_model, p.device)
    write_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        with LLM(**engine_kwargs(p, model_dir, layouts=("tp",), park="never", compile=ctx.engine_compile,
                                 decode_buckets=(1,))) as llm:
            boot_s = time.perf_counter() - t0
            tok_s = decode_rates(llm, (1,), p.prompt_len, p.bench_tokens)[1]
            stats = llm.stats()
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    weight_bytes, bw = stats["shard_bytes"][0]["tp"], ctx.shared.get("device_bw")
    bound = None if bw is None else bw / weight_bytes
    fraction = None if bound is None else tok_s / bound
    return {"ok": True, "model_write_s": write_s, "boot_s": boot_s, "weight_bytes": weight_bytes,
            "engine_compile": ctx.engine_compile, "tokens_per_s_batch_1": tok_s, "bandwidth_bound_tokens_per_s": bound,
            "fraction_of_bound": fraction, "target": ">= 0.75 of the bound",
            "meets_target": None if fraction is None else fraction >= 0.75,
            "eager_fallbacks": stats["eager_fallbacks"]}


def compile_boot(ctx: Context) -> dict:
    from phaseflip.tools.gpu_sections_engine import engine_kwargs, write_model
    p = ctx.profile
    if "llm" in ctx.shared:
        ctx.shared.pop("llm").shutdown()
    models = {}
    for name, shape in p.compile_models:
        shared_1b = name == "llama-1b" and "model_dir" in ctx.shared
        model_dir = ctx.shared["model_dir"] if shared_1b else write_model(ctx.work / name, shape, p.device)
        spec = {"engine": engine_kwargs(p, model_dir, compile=p.compile_mode), "batches": list(p.bench_batches),
                "prompt_len": p.prompt_len, "new_tokens": p.bench_tokens}
        cache = ctx.work / f"compile-cache-{name}"
        m = models[name] = {"cold": _boot(ctx, spec, cache)}
        m["warm"] = _boot(ctx, spec, cache) if m["cold"]["finished"] else {"finished": False,
                                                                            "reason": "no cold boot to warm from"}
        if shared_1b and ctx.engine_compile == "off" and "ours" in ctx.shared:
            m["uncompiled"] = {"finished": True, "tokens_per_s": ctx.shared["ours"],
                               "from": "section decode_throughput (the same engine with compile='off')"}
        else:
            off = {**spec, "engine": {**spec["engine"], "compile": "off"}}
            m["uncompiled"] = _boot(ctx, off, ctx.work / f"compile-cache-{name}-off")
        m.update(_compare(m, p.compile_mode))
    finished = all(run["finished"] for m in models.values() for run in (m["cold"], m["warm"], m["uncompiled"]))
    return {"ok": finished, "compile": p.compile_mode, "models": models, "targets": TARGETS,
            "rule": "compile_s: the compile:<layout> boot phases of rank 0 summed; speedup: decode tokens/s "
                    "of the warm compiled boot over the uncompiled engine's, per batch"}


def _compare(m: dict, mode: str) -> dict:
    """The figures the targets are judged on, or None where a boot did not finish (or nothing compiled)."""
    cold, warm, off = m["cold"], m["warm"], m["uncompiled"]
    compiled = warm if warm["finished"] else cold
    speedup = None
    if compiled["finished"] and off["finished"]:
        speedup = {int(b): compiled["tokens_per_s"][b] / off["tokens_per_s"][b] for b in compiled["tokens_per_s"]}
    cold_s, warm_s = cold.get("compile_s"), warm.get("compile_s")
    return {"cold_compile_s": cold_s, "warm_compile_s": warm_s, "speedup": speedup,
            "targets_met": None if mode == "off" or None in (cold_s, warm_s, speedup) else
            cold_s <= 30 and warm_s <= 5 and speedup[1] >= 1.15 and min(speedup.values()) >= 1.0}


def _boot(ctx: Context, spec: dict, cache: Path) -> dict:
    """One boot in a fresh process with inductor's and Triton's caches under `cache`."""
    left = ctx.deadline + GRACE_S - time.monotonic()
    if left <= 0:
        return {"finished": False, "reason": "time budget spent"}
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"),
               PHASEFLIP_CACHE=str(cache / "phaseflip"))   # no record of an earlier boot: cold is cold
    _share_kernels(cache / "phaseflip")
    try:
        proc = subprocess.run([sys.executable, "-m", __name__, json.dumps(spec)], env=env, capture_output=True,
                              text=True, timeout=left)
    except subprocess.TimeoutExpired:
        return {"finished": False, "reason": f"did not finish within the {left:.0f} s left of the budget"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(CHILD_MARK)]
    if proc.returncode != 0 or not lines:
        return {"finished": False, "reason": f"the boot process exited {proc.returncode}",
                "stderr_tail": proc.stderr[-2000:]}
    result = json.loads(lines[-1][len(CHILD_MARK):])
    result["tokens_per_s"] = {int(b): v for b, v in result["tokens_per_s"].items()}
    return {"finished": True, **result}


def _share_kernels(phaseflip_cache: Path) -> None:
    """The CPU kernels' build (not what this section times) taken from the user's phaseflip cache."""
    built, here = cache_dir() / "kernels", phaseflip_cache / "kernels"
    if built.is_dir() and not here.exists():
        phaseflip_cache.mkdir(parents=True, exist_ok=True)
        here.symlink_to(built, target_is_directory=True)


def _child(spec: dict) -> dict:
    """Boot, report the boot and compile figures, decode at each batch (runs in the child process)."""
    from phaseflip import LLM
    from phaseflip.tools.gpu_sections_engine import decode_rates
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["engine"].items()}
    t0 = time.perf_counter()
    with LLM(**kwargs) as llm:
        boot_s = time.perf_counter() - t0
        rank = llm.inspect()["ranks"][0]
        rates = decode_rates(llm, spec["batches"], spec["prompt_len"], spec["new_tokens"])
    boot_ms = rank["boot_ms"]
    choices = {layout: {role: r.get("choice") if isinstance(r, dict) else r for role, r in report.items()}
               for layout, report in rank["compile"].items()}
    return {"boot_s": boot_s, "compile_s": sum(v for k, v in boot_ms.items() if k.startswith("compile:")) / 1e3,
            "boot_ms": boot_ms, "choices": choices, "tokens_per_s": rates}


if __name__ == "__main__":
    print(CHILD_MARK + json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
