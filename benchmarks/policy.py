"""Policy benchmark (not a test): 2 ranks, SmolLM2, 64 prompts of mixed length; throughput of the
policy, static PP and static TP measured in the same run, and the policy's flips.

Usage: python benchmarks/policy.py [--model DIR] [--prompts 64]
"""
from __future__ import annotations

import argparse
import random
import time

from phaseflip import LLM, SamplingParams

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly box jugs of "
         "liquid gold near the old stone bridge at dawn").split()


def workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120))) for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(8, 64), ignore_eos=True) for _ in range(n)]
    return prompts, params


def run(model, prompts, params, **kw):
    with LLM(model=model, world_size=2, max_model_len=512, max_num_seqs=16, **kw) as llm:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        stats = llm.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tok_s": tokens / seconds, "seconds": seconds, "flips": stats["flips"],
            "ids": [o.outputs[0].token_ids for o in outs], "decisions": stats["num_decisions"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=64)
    args = ap.parse_args()
    prompts, params = workload(args.prompts)
    runs = {"policy": run(args.model, prompts, params, park="always"),
            "static pp": run(args.model, prompts, params, layouts=("pp",)),
            "static tp": run(args.model, prompts, params, layouts=("tp",))}
    best_static = max(runs["static pp"]["tok_s"], runs["static tp"]["tok_s"])
    print(f"{'run':10} {'tok/s':>8} {'seconds':>8} {'flips':>6} {'x best static':>14}")
    for name, r in runs.items():
        print(f"{name:10} {r['tok_s']:8.1f} {r['seconds']:8.1f} {r['flips']:6d} {r['tok_s'] / best_static:14.2f}")
    same = runs["policy"]["ids"] == runs["static pp"]["ids"] == runs["static tp"]["ids"]
    print(f"greedy outputs identical across the three runs: {same}")


if __name__ == "__main__":
    main()
