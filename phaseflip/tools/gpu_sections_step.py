"""The GPU check's decode_step section: what one batch-1 decode step costs the host and the device.

Owns: `decode_step`, which runs the shared engine (section capture) for two lengths of one request
(greedy, then seeded temperature + top-k + top-p: sampling inside the step) and takes the difference, so the prefill, the flip to the decode layout and the first token
cancel out: per decode step, the host syncs (torch.cuda's sync debug mode, which reports every
synchronising call it knows), the device operations (kernels, copies, fills) and their summed time
against the wall time (torch profiler), and the copies of step inputs to the device (the static
buffers' upload count). Issue targets: at most one host sync per decode step, one input copy. On the
CPU (dry run) only the upload count and the wall time exist; the device figures are None with the
reason.
"""
from __future__ import annotations

import time
import warnings

from phaseflip.tools.gpu_context import Context

SHORT, LONG = 4, 20   # new tokens of the two runs: LONG - SHORT decode steps are compared
REPEATS = 5           # runs of each length


def _params(new_tokens: int, sampled: bool):
    from phaseflip.engine.sampling_params import SamplingParams
    if sampled:   # the filtered path: temperature, top-k and top-p, seeded
        return SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=7, max_tokens=new_tokens, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)


def _one_run(llm, prompt: list[int], new_tokens: int, cuda: bool, sampled: bool = False) -> dict:
    import torch
    buffers = llm.ranks.runtime.buffers
    uploads0, steps0 = buffers.uploads, llm.stats()["steps"]
    out = {"syncs": None, "kernels": None, "kernel_ms": None}   # device figures (CUDA)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with warnings.catch_warnings(record=True) as caught, torch.profiler.profile(activities=activities) as prof:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        t0 = time.perf_counter()
        try:
            llm.generate([prompt], _params(new_tokens, sampled), use_tqdm=False)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        out["wall_ms"] = (time.perf_counter() - t0) * 1e3
    if cuda:
        out["syncs"] = sum("synchroniz" in str(w.message) for w in caught)
        device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        out["kernels"] = len(device)
        out["kernel_ms"] = sum(e.device_time_total for e in device) / 1e3   # µs each
    out["uploads"] = buffers.uploads - uploads0
    out["steps"] = llm.stats()["steps"] - steps0
    return out


def _per_step(short: dict, long: dict, key: str):
    if short[key] is None or long[key] is None:
        return None
    per = (long[key] - short[key]) / (long["steps"] - short["steps"])
    return None if key == "wall_ms" and per <= 0 else per   # noise outweighed the steps: not a measure


def _best_of(runs) -> dict:
    """The counts of the first run (every run counts the same), the least wall time."""
    return {**runs[0], "wall_ms": min(r["wall_ms"] for r in runs)}


def _compare(llm, prompt: list[int], cuda: bool, sampled: bool) -> dict:
    """Short and long runs taken in turn (a slow spell of a busy machine then slows both, not all of
    one kind), REPEATS of each: the least wall time of each length."""
    _one_run(llm, prompt, LONG, cuda, sampled)                      # warm: every size these runs use
    pairs = [(_one_run(llm, prompt, SHORT, cuda, sampled), _one_run(llm, prompt, LONG, cuda, sampled))
             for _ in range(REPEATS)]
    short, long = (_best_of(runs) for runs in zip(*pairs))
    per = {key: _per_step(short, long, key) for key in ("syncs", "kernels", "kernel_ms", "wall_ms", "uploads")}
    busy = None if per["kernel_ms"] is None or per["wall_ms"] is None else per["kernel_ms"] / per["wall_ms"]
    out = {"decode_steps_compared": long["steps"] - short["steps"], "syncs_per_step": per["syncs"],
           "kernels_per_step": per["kernels"], "gpu_busy_fraction": busy, "wall_ms_per_step": per["wall_ms"],
           "input_uploads_per_step": per["uploads"], "runs": {"short": short, "long": long}}
    if per["wall_ms"] is None:
        out["why_no_wall_ms"] = "the long runs' least wall time was not above the short runs': the machine's noise"
    return out


def decode_step(ctx: Context) -> dict:
    import torch
    llm = ctx.need("llm", "capture")
    cuda = ctx.profile.device == "cuda" and torch.cuda.is_available()
    prompt = list(range(3, 3 + ctx.profile.prompt_len))
    out = _compare(llm, prompt, cuda, sampled=False)
    out["sampled"] = _compare(llm, prompt, cuda, sampled=True)   # temperature + top-k + top-p, seeded
    out["targets"] = {"syncs_per_step": "<= 1", "input_uploads_per_step": "1 (CUDA)"}
    if not cuda:
        out["why_none"] = "no CUDA device: syncs, kernels and GPU-busy time are device figures"
        out["ok"] = all(r["wall_ms_per_step"] is not None and r["wall_ms_per_step"] > 0 for r in (out, out["sampled"]))
    else:
        out["ok"] = all(r["syncs_per_step"] is not None and r["syncs_per_step"] <= 1 and r["input_uploads_per_step"] == 1
                        for r in (out, out["sampled"]))
    return out
