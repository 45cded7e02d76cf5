"""The GPU check's device sections: environment (versions, device), kernels (every Triton kernel case
against its torch reference, plus one CUDA-graph replay) and bandwidth (device-to-device and pinned
host-to-device copies), with the timing helpers they and later sections use. Must never boot an engine.
"""
from __future__ import annotations

import time

from phaseflip.tools.gpu_context import Context


def sync_device(device: str) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for elsewhere."""
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


def _time_ms(device: str, fn, repeats: int) -> float:
    """Mean ms of fn() over `repeats` runs after one warm-up: CUDA events on the GPU, wall time elsewhere."""
    import torch
    fn()
    sync_device(device)
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) * 1e3 / repeats



def environment(ctx: Context) -> dict:
    import platform
    import torch
    out = {"ok": True, "dry_run": ctx.dry_run, "python": platform.python_version(), "torch": torch.__version__,
           "cuda_runtime": torch.version.cuda, "device": ctx.profile.device}
    for name in ("triton", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError as e:
            out[name] = None
            out[f"{name}_error"] = str(e)
    from phaseflip.kernels import dispatch
    from phaseflip.rank import forward
    out["engine_kernels"] = {
        "attention_and_kv_store": "triton (inside phaseflip::paged_attention)" if dispatch.triton_available()
        else "torch reference (triton missing)",
        "norm_rotary_silu": "triton via kernels.dispatch" if getattr(forward, "rms_norm", None) is dispatch.rms_norm
        else "torch references (rank/forward.py does not call kernels.dispatch)"}
    if ctx.profile.device == "cuda":
        prop = torch.cuda.get_device_properties(0)
        out.update(device_name=prop.name, sm_count=prop.multi_processor_count, device_memory_bytes=prop.total_memory)
    return out


def kernels(ctx: Context) -> dict:
    from phaseflip.kernels import selfcheck
    names = list(ctx.profile.kernel_cases or selfcheck.CASES)
    t0 = time.perf_counter()
    results = selfcheck.run_cases(ctx.profile.device, names)
    failed = [r for r in results if not r["ok"]]
    try:
        replay = {"ok": True, **selfcheck.graph_replay_check(ctx.profile.device)}
    except Exception as e:  # noqa: BLE001
        replay = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return {"ok": not failed and replay["ok"], "num_cases": len(results), "num_passed": len(results) - len(failed),
            "failed": [r["name"] for r in failed], "seconds": time.perf_counter() - t0,
            "max_abs_err": max((r["max_abs_err"] for r in results if r["ok"]), default=None),
            "graph_replay": replay, "cases": results,
            "note": "dry run: a subset through Triton's interpreter" if ctx.dry_run else "real launches"}


def bandwidth(ctx: Context) -> dict:
    import torch
    p = ctx.profile
    n = p.copy_bytes
    src = torch.empty(n, dtype=torch.uint8, device=p.device).fill_(1)
    dst = torch.empty_like(src)
    copy_ms = _time_ms(p.device, lambda: dst.copy_(src), repeats=10)
    pinned = p.device == "cuda"
    host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned).fill_(2)
    h2d_ms = _time_ms(p.device, lambda: dst.copy_(host, non_blocking=True), repeats=5)
    ctx.shared["device_bw"] = 2 * n / (copy_ms / 1e3)
    ctx.shared["h2d_bw"] = n / (h2d_ms / 1e3)
    del src, dst, host
    return {"ok": True, "bytes": n, "device_copy_ms": copy_ms, "device_gb_s": ctx.shared["device_bw"] / 1e9,
            "device_traffic_rule": "2 bytes of traffic per byte copied", "h2d_ms": h2d_ms,
            "h2d_gb_s": ctx.shared["h2d_bw"] / 1e9, "h2d_pinned": pinned}

