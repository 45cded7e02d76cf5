"""The memory ledger of one rank: where every byte of its budget went, per layout.

Owns: `measure_memory` (what the process holds at the end of boot: RSS on the CPU, allocator and
device totals on CUDA) and `rank_ledger`, which attributes the budget to arena, KV region (usable and
unusable blocks of each view), graph pool (CPU: the RSS the boot's GEMM warm-up added), static
buffers, staging reserve, host images (CPU: the host is the device), framework overhead and free.
`free` is the remainder, so the terms sum to the budget exactly; an unmeasured term is None and then
`free` is None too, with the reason in `unmeasured`.
"""
from __future__ import annotations

import torch


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def measure_memory(rt) -> dict:
    if rt.device == "cpu":
        return {"kind": "cpu", "rss_bytes": rss_bytes()}
    free, total = torch.cuda.mem_get_info(rt.device)
    return {"kind": "cuda", "device_total": total, "device_free": free,
            "reserved": torch.cuda.memory_reserved(rt.device), "allocated": torch.cuda.memory_allocated(rt.device)}


def _pool_bytes(rt) -> int | None:
    steps = rt.registry.steps()
    if rt.device == "cpu":
        return rt.gemm_bytes  # recorded CPU steps own no pool; their GEMMs (kernels/linear.py) do
    sizes = [s.pool_bytes for s in steps]
    return None if any(v is None for v in sizes) else sum(sizes)


def _framework(rt, known: int, pool: int | None) -> int | None:
    """What the runtime itself holds beyond the listed terms (torch, Python, CUDA context)."""
    m = rt.memory
    if m["kind"] == "cpu":
        # Resident at boot: arena, buffers and host images are touched; the KV region is calloc'd
        # and mostly untouched, so it is not in the RSS yet.
        touched = rt.arena.num_bytes + rt.buffers.num_bytes + rt.host_image_bytes
        return None if m["rss_bytes"] is None or pool is None else m["rss_bytes"] - touched - pool
    if pool is None:
        return None
    used = m["device_total"] - m["device_free"]
    return used - known - pool


def rank_ledger(rt, layout: str, num_blocks: int) -> dict:
    view = rt.kv.view(layout)
    block_bytes = view.shape.bytes_per_block(rt.kv.dtype)
    kv_usable = num_blocks * block_bytes
    pool = _pool_bytes(rt)
    terms = {
        "arena": rt.arena.num_bytes,
        "kv_usable": kv_usable,
        "kv_unusable": rt.kv.num_bytes - kv_usable,
        "graph_pool": pool,
        "static_buffers": rt.buffers.num_bytes,
        "staging_reserve": 2 * view.shape.numel * view.tensor.element_size(),  # read copy + received
        "host_images": rt.host_image_bytes if rt.device == "cpu" else 0,
    }
    known = sum(v for k, v in terms.items() if v is not None and k not in ("graph_pool", "staging_reserve"))
    terms["framework_overhead"] = _framework(rt, known, pool)
    unmeasured = [k for k, v in terms.items() if v is None]
    budget = rt.budget_bytes
    if budget is None:
        unmeasured.append("budget")
    free = None if unmeasured else budget - sum(terms.values())
    return {"layout": layout, "budget": budget, **terms, "free": free, "unmeasured": unmeasured,
            "arena_layout_bytes": rt.shard_bytes[layout], "kv_block_bytes": block_bytes,
            "sums_to_budget": None if free is None else sum(terms.values()) + free == budget}
