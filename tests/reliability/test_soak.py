"""Soak (marked slow; about a minute on 2 cores): 1000 requests of random lengths and
parameters on 2 ranks under the default policy plus random forced flips and a small KV pool; every
request completes, every greedy one equals the single-rank reference, nothing is left after each
call, and RSS stays within a bound of its value after the first call."""
from __future__ import annotations

import gc
import os
import random
import time

import pytest

from phaseflip import LLM, SamplingParams
from tests.reliability.support import ENGINE, assert_settled, deadline, rss_bytes

NUM_REQUESTS = 1000
NUM_CALLS = 10
FLIP_CHANCE = 0.1        # after each step, a forced flip with this probability
RSS_BOUND = 32 * 2**20   # growth allowed per process from the first call's end to the last's


_prefix_rng = random.Random(7)
SHARED_PREFIXES = [[_prefix_rng.randrange(3, 384) for _ in range(n)] for n in (12, 20, 37, 64)]
SHARED_CHANCE = 0.4      # a request's prompt starts with one of SHARED_PREFIXES (prefix caching)


def random_request(rng: random.Random):
    prompt = [rng.randrange(3, 384) for _ in range(rng.randrange(1, 100))]
    if rng.random() < SHARED_CHANCE:
        prompt = rng.choice(SHARED_PREFIXES) + prompt[:40]
    max_tokens = rng.randrange(1, 33)
    if rng.random() < 0.5:
        return prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return prompt, SamplingParams(temperature=rng.choice([0.5, 1.0]), top_p=rng.choice([0.9, 1.0]),
                                  top_k=rng.choice([0, 40]), seed=rng.choice([None, rng.randrange(10**6)]),
                                  max_tokens=max_tokens, stop=rng.choice([None, ["e"], ["ab", "z"]]),
                                  logprobs=rng.choice([None, 1]))


def force_random_flips(llm, rng: random.Random) -> None:
    after_step = llm.control.after_step

    def maybe_flip(summary):
        after_step(summary)
        if rng.random() < FLIP_CHANCE:
            llm.control.flip(llm.control.other())
    llm.control.after_step = maybe_flip


@pytest.mark.slow
def test_soak_1000_requests_on_2_ranks(model, reference):
    rng = random.Random(1000)
    requests = [random_request(rng) for _ in range(NUM_REQUESTS)]
    t0 = time.monotonic()
    with LLM(model=model, **{**ENGINE, "max_num_seqs": 16}, world_size=2, num_kv_blocks=48) as llm, \
            deadline(280, "the soak"):
        pids = [os.getpid()] + llm.stats()["rank_pids"]
        force_random_flips(llm, rng)
        outputs, rss = [], []
        size = NUM_REQUESTS // NUM_CALLS
        for call in range(NUM_CALLS):
            batch = requests[call * size:(call + 1) * size]
            outputs += llm.generate([p for p, _ in batch], [sp for _, sp in batch], use_tqdm=False)
            stats = assert_settled(llm)
            gc.collect()
            rss.append([rss_bytes(p) for p in pids])
    seconds = time.monotonic() - t0
    assert len(outputs) == NUM_REQUESTS and all(o.finished for o in outputs)
    assert all(len(o.outputs[0].token_ids) <= sp.max_tokens for o, (_, sp) in zip(outputs, requests))
    greedy_at = [i for i, (_, sp) in enumerate(requests) if sp.greedy]
    by_len: dict[int, list[int]] = {}
    for i in greedy_at:
        by_len.setdefault(requests[i][1].max_tokens, []).append(i)
    for max_tokens, at in by_len.items():
        expected = reference([requests[i][0] for i in at], max_tokens)
        assert [outputs[i].outputs[0].token_ids for i in at] == expected, f"greedy max_tokens={max_tokens}"
    growth = [last - first for first, last in zip(rss[0], rss[-1])]
    pc = stats["prefix_cache"]
    print(f"\n[soak] {NUM_REQUESTS} requests ({len(greedy_at)} greedy) in {seconds:.0f} s: {stats['steps']} "
          f"steps, {stats['flips']} flips ({stats['failed_flips']} failed), {stats['num_preemptions']} "
          f"preemptions; prefix cache: {pc['prompt_tokens_reused']} prompt tokens reused, "
          f"{pc['prompt_tokens_computed']} computed, {pc['evictions']} evictions; RSS growth after call 1 (MiB): "
          + ", ".join(f"{name} {g / 2**20:+.1f}" for name, g in zip(["controller", "rank 0", "rank 1"], growth)))
    assert stats["flips"] > 50 and stats["num_preemptions"] > 0 and stats["failed_flips"] == 0
    assert pc["prompt_tokens_reused"] > 0 and pc["evictions"] > 0
    assert all(g <= RSS_BOUND for g in growth), growth
