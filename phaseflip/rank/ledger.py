"""The memory ledger of one rank: where every byte of its budget went, per layout, and how far the
sum of what was measured is from what the device says is used.

Owns: `measure_memory` (what the process or device holds: RSS on the CPU; the driver's free memory and the
caching allocator's reserved bytes on CUDA), `graph_pool_bytes` (a CUDA graph pool's segments, read from the
allocator's own snapshot), `rss_growth` / `add_growth` (what a boot phase added to the RSS) and
`rank_ledger`. Every term is measured on its own, never derived as a remainder: arena, KV region (usable and
unusable blocks of each view), graph pool (CPU: the RSS the boot's GEMM warm-up and product-form
measurements added), compiled code (CPU: the RSS compiling added), static buffers, staging reserve, host
images (CPU: those outside the arena), allocator cache (CUDA: reserved bytes no listed tensor holds),
framework overhead (what the process or device used before the rank's first allocation). The identity is
then checked against the measured use: `unexplained` is the difference, shown as it is (signed) and never
folded into another term; `free` is the budget less both. A term that could not be measured is None, and
then `free` is None too, with the reason in `unmeasured`.
"""
from __future__ import annotations

from contextlib import contextmanager

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


@contextmanager
def rss_growth():
    """Yields a list that holds, after the block, the bytes the process's RSS grew by (None where
    /proc cannot be read)."""
    before, out = rss_bytes(), []
    yield out
    after = rss_bytes()
    out.append(None if before is None or after is None else after - before)


def add_growth(total: int | None, grown: list) -> int | None:
    """total plus what rss_growth measured; None where either is unmeasured."""
    return None if total is None or grown[0] is None else total + grown[0]


def measure_memory(device: str) -> dict:
    if device == "cpu":
        return {"kind": "cpu", "rss_bytes": rss_bytes()}
    free, total = torch.cuda.mem_get_info(device)
    return {"kind": "cuda", "device_total": total, "device_free": free, "device_used": total - free,
            "reserved": torch.cuda.memory_reserved(device), "allocated": torch.cuda.memory_allocated(device)}


def graph_pool_bytes(pool) -> int | None:
    """Bytes of the allocator segments that belong to the CUDA graph pool `pool` (its own statistics,
    not a before/after difference that other frees can make negative); None if unreadable."""
    try:
        segments = torch.cuda.memory_snapshot()
    except RuntimeError:
        return None
    return sum(s["total_size"] for s in segments if tuple(s.get("segment_pool_id", ())) == tuple(pool))


def _used(m: dict) -> int | None:
    """What the process (CPU) or the device (CUDA, every process on it) uses, as measured."""
    return m.get("rss_bytes") if m["kind"] == "cpu" else m["device_used"]


def _terms(rt, layout: str, num_blocks: int) -> dict[str, int | None]:
    view = rt.kv.view(layout)
    kv_usable = num_blocks * view.shape.bytes_per_block(rt.kv.dtype)
    cpu = rt.device == "cpu"
    terms = {
        "arena": rt.arena.num_bytes,
        "kv_usable": kv_usable,
        "kv_unusable": rt.kv.num_bytes - kv_usable,
        "graph_pool": _grown(rt.gemm_bytes if cpu else rt.graph_pool_bytes),
        "compiled_code": _grown(rt.compile_bytes) if cpu else 0,
        "static_buffers": rt.buffers.num_bytes,
        "staging_reserve": 0 if rt.staging is None else rt.staging.num_bytes,  # the flip's send + receive
        "host_images": rt.host_image_bytes if cpu else 0,  # CUDA: pinned host memory, not the device's
        "allocator_cache": 0,
        "framework_overhead": _used(rt.memory_at_start),
    }
    if not cpu:
        listed = terms["arena"] + rt.kv.num_bytes + terms["static_buffers"] + (terms["graph_pool"] or 0)
        terms["allocator_cache"] = max(0, rt.memory["reserved"] - listed)
    return terms


def _grown(delta: int | None) -> int | None:
    """A growth measured as a before/after difference; a shrink (memory another object gave back in
    the meantime) counts as none, and the difference shows up in `unexplained`."""
    return None if delta is None else max(0, delta)


# What each device's measured use is made of: on the CPU what boot touched (the KV region and the
# staging reserve are calloc'd address space, not resident yet); on CUDA everything the caching
# allocator reserved (the KV region and graph pool included) beyond the use at start.
RESIDENT = {
    "cpu": ("framework_overhead", "arena", "static_buffers", "host_images", "graph_pool", "compiled_code"),
    "cuda": ("framework_overhead", "arena", "kv_usable", "kv_unusable", "static_buffers", "graph_pool",
             "allocator_cache"),
}


def _explained(rt, terms: dict) -> int | None:
    """The part of the measured use the terms account for (None when one of them is unmeasured)."""
    values = [terms[k] for k in RESIDENT["cpu" if rt.device == "cpu" else "cuda"]]
    return None if None in values else sum(values)


def rank_ledger(rt, layout: str, num_blocks: int) -> dict:
    terms = _terms(rt, layout, num_blocks)
    used, explained = _used(rt.memory), _explained(rt, terms)
    unexplained = None if used is None or explained is None else used - explained
    unmeasured = [k for k, v in terms.items() if v is None]
    if unexplained is None:
        unmeasured.append("unexplained")
    budget = rt.budget_bytes
    if budget is None:
        unmeasured.append("budget")
    free = None if unmeasured else budget - sum(terms.values()) - unexplained
    return {"layout": layout, "budget": budget, **terms, "unexplained": unexplained, "free": free,
            "measured_used": used, "unmeasured": unmeasured, "arena_layout_bytes": rt.shard_bytes[layout],
            "kv_block_bytes": rt.kv.view(layout).shape.bytes_per_block(rt.kv.dtype),
            "sums_to_budget": None if free is None else sum(terms.values()) + unexplained + free == budget}
