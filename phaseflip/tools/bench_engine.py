"""The engine side of `phaseflip bench`: the same workloads, timed the same way as bench_hf.py.

Owns: offline throughput and single-stream figures on one rank, the shared-prefix batch with prefix
caching on and off, and the two-rank flip figures (each
flip's components against its copy floor: the bytes its ranks move over the host's memcpy bandwidth
measured in this same run) with the boot phases.
"""
from __future__ import annotations

import statistics
import time

import torch

from phaseflip.engine.llm import LLM
from phaseflip.engine.sampling_params import SamplingParams
from phaseflip.tools import bench_single
from phaseflip.tools.bench_workload import Workload

FLIP_PARTS = ("read", "exchange", "refill", "write", "cutover")


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def offline(llm: LLM, work: Workload) -> dict:
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [_greedy(m) for m in work.max_tokens], use_tqdm=False)
    seconds = time.perf_counter() - t0
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "output_tokens": got, "tokens_per_s": got / seconds,
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def single_stream(llm: LLM, work: Workload, repeats: int = 3) -> dict:
    prompt, n = {"prompt_token_ids": work.prompts[0]}, work.max_tokens[0]

    def timed(k: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompt, _greedy(k), use_tqdm=False)
        return time.perf_counter() - t0
    return bench_single.single_stream(timed, n, repeats)


def run_single_rank(model: str | None, threads: int, offline_work: Workload | None,
                    single_work: Workload | None, max_model_len: int) -> dict:
    result: dict = {}
    # no prefix caching: the single stream repeats its prompt, which caching would not compute again
    # (HF computes it every time); the shared-prefix part measures caching
    with LLM(model=model, dtype="float32", num_threads=threads, max_model_len=max_model_len,
             enable_prefix_caching=False) as llm:
        result["boot_ms"] = dict(llm.stats()["boot_ms"])
        llm.generate("Hello there", _greedy(4), use_tqdm=False)  # warm-up
        if single_work is not None:
            result["single"] = single_stream(llm, single_work)
        if offline_work is not None:
            result["offline"] = offline(llm, offline_work)
    return result


def memcpy_gbps(num_bytes: int = 256 * 2**20, repeats: int = 9) -> float:
    """The host's copy bandwidth (bytes copied per second, each byte counted once), the median of
    `repeats` copies of 256 MiB with torch's threads: the best single copy can read far faster than the
    median, which would make every floor of the run too low."""
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return num_bytes / statistics.median(times) / 1e9


def first_touch_gbps(num_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes per second written into freshly allocated host memory (each page faulted in, zeroed by the
    kernel, then written): the floor of any pack into new memory, which memcpy between buffers already
    touched does not pay. The median of `repeats` allocations."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.empty(num_bytes, dtype=torch.uint8).fill_(1)
        times.append(time.perf_counter() - t0)
    return num_bytes / statistics.median(times) / 1e9


def pack_rows(stats: dict, memcpy: float, first_touch: float) -> dict:
    """Each rank's pack (its host images, built at boot) and all ranks' together (they pack at the same
    time on one host: all bytes over the longest pack), against the memcpy and first-touch bandwidths."""
    def row(num_bytes: int, ms: float | None) -> dict:
        gbps = None if not ms else num_bytes / (ms / 1e3) / 1e9
        return {"pack_ms": ms, "bytes": num_bytes, "gbps": gbps, "of_memcpy": None if gbps is None else gbps / memcpy,
                "of_first_touch": None if gbps is None else gbps / first_touch}
    ranks = [{"rank": rank, **row(sum(shard_bytes.values()), boot_ms.get("pack"))}
             for rank, (boot_ms, shard_bytes) in enumerate(zip(stats["rank_boot_ms"], stats["shard_bytes"]))]
    times = [r["pack_ms"] for r in ranks]
    return {"ranks": ranks, "all": row(sum(r["bytes"] for r in ranks), None if None in times else max(times))}


def run_prefix(model: str | None, threads: int, work: Workload, max_model_len: int) -> dict:
    """The shared-prefix batch on one rank with prefix caching on, then off (a fresh engine each)."""
    result: dict = {}
    for on in (True, False):
        with LLM(model=model, dtype="float32", num_threads=threads, max_model_len=max_model_len,
                 enable_prefix_caching=on) as llm:
            llm.generate("Hello there", _greedy(4), use_tqdm=False)  # warm-up
            result["on" if on else "off"] = {**offline(llm, work), "prefix_cache": llm.stats()["prefix_cache"]}
    return result


def flip_rows(flip_log: list[dict], gbps: float) -> list[dict]:
    """Each flip against its copy floor. The ranks of one host share its memory bus, so the floor is
    the bytes ALL ranks move (weight refill + KV sent) over the host's memcpy bandwidth; the floor of
    the busiest rank alone at that bandwidth (the per-device floor of a multi-GPU rig) is reported too."""
    rows = []
    for e in flip_log:
        per_rank = [r["weight_bytes"] + r["kv_bytes"] for r in e["per_rank"]]
        floor_ms = sum(per_rank) / (gbps * 1e9) * 1e3
        busiest_ms = max(per_rank) / (gbps * 1e9) * 1e3
        rows.append({"direction": e["direction"], "ok": e["ok"], "total_ms": e["total_ms"],
                     **{f"{c}_ms": e.get(f"{c}_ms") for c in FLIP_PARTS},
                     "bytes_moved": sum(per_rank), "chunks": e["chunks"], "staging_bytes": e["staging_bytes"],
                     "floor_ms": floor_ms, "busiest_rank_floor_ms": busiest_ms,
                     "ratio": e["total_ms"] / floor_ms if floor_ms else None,
                     "within_target": e["total_ms"] <= 1.5 * floor_ms + 10.0})
    return rows


def run_flips(model: str | None, world_size: int, flip_every: int, prompts: list[str], max_model_len: int,
              staging_mib: float | None = None) -> dict:
    gbps, first_touch = memcpy_gbps(), first_touch_gbps()
    with LLM(model=model, dtype="float32", world_size=world_size, park="always", max_model_len=max_model_len,
             flip_every_steps=flip_every, flip_staging_mib=staging_mib) as llm:
        llm.generate(prompts, _greedy(48), use_tqdm=False)
        stats = llm.stats()
    return {"memcpy_gbps": gbps, "first_touch_gbps": first_touch, "world_size": world_size,
            "boot_ms": stats["boot_ms"], "rank_boot_ms": stats["rank_boot_ms"],
            "pack": pack_rows(stats, gbps, first_touch), "flips": flip_rows(stats["flip_log"], gbps)}
