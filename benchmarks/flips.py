"""Flip benchmark (not a test): each flip's components and its ratio to the copy floor.

The copy floor of a flip is the bytes its slowest rank moves (weight refill + KV sent) divided by the
memcpy bandwidth measured in this same run. Usage: python benchmarks/flips.py [--model DIR]
[--world-size 2] [--park always] [--flip-every 4]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from phaseflip import LLM, SamplingParams


def memcpy_gbps(num_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--park", default="always")
    ap.add_argument("--flip-every", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    bw = memcpy_gbps()
    prompts = [f"Tell me a short story about the number {i}." for i in range(8)]
    with LLM(model=args.model, world_size=args.world_size, park=args.park, max_model_len=1024,
             flip_every_steps=args.flip_every) as llm:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
        log = llm.stats()["flip_log"]
    rows = []
    for e in log:
        moved = max(r["weight_bytes"] + r["kv_bytes"] for r in e["per_rank"])
        floor_ms = moved / (bw * 1e9) * 1e3
        rows.append({**{k: e[k] for k in ("direction", "total_ms", "read_ms", "exchange_ms", "refill_ms",
                                           "write_ms", "cutover_ms", "kv_bytes", "weight_bytes")},
                     "floor_ms": floor_ms, "ratio": e["total_ms"] / floor_ms if floor_ms else None})
    if args.json:
        print(json.dumps({"memcpy_gbps": bw, "flips": rows}, indent=2))
        return
    print(f"memcpy bandwidth (this run): {bw:.2f} GB/s; {len(rows)} flips, world size {args.world_size}, "
          f"park={args.park}")
    print(f"{'dir':7} {'total':>8} {'read':>7} {'exch':>7} {'refill':>7} {'write':>7} {'cut':>6} "
          f"{'kv MB':>7} {'w MB':>7} {'floor':>7} {'ratio':>6}")
    for r in rows:
        print(f"{r['direction']:7} {r['total_ms']:8.1f} {r['read_ms']:7.1f} {r['exchange_ms']:7.1f} "
              f"{r['refill_ms']:7.1f} {r['write_ms']:7.1f} {r['cutover_ms']:6.1f} {r['kv_bytes'] / 1e6:7.2f} "
              f"{r['weight_bytes'] / 1e6:7.1f} {r['floor_ms']:7.1f} {r['ratio']:6.2f}")
    print(f"median ratio to the copy floor: {statistics.median(r['ratio'] for r in rows):.2f}")


if __name__ == "__main__":
    main()
