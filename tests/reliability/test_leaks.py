"""Leaks: after every generate (clean, stopped early, refused, failed in-process)
every KV block is free and no request state remains on the controller or a rank; 200 generate calls
of random sizes with forced flips leave each process's RSS within a stated bound of its RSS at the
tenth call (call 10, not call 1: allocator pools and lazily built kernels warm up first)."""
from __future__ import annotations

import gc
import os
import random

import pytest

from phaseflip import LLM, SamplingParams
from phaseflip.engine.ranks.group import RankError
from phaseflip.rank.messages import ArmFault
from tests.reliability.support import ENGINE, assert_settled, deadline, rss_bytes

NUM_CALLS = 200
SAMPLED_CALLS = (10, 50, 100, 150, NUM_CALLS)   # where RSS is read (after a gc.collect, which is slow)
RSS_BOUND = 8 * 2**20    # growth allowed per process between call 10 and call 200 (measured: about 2 MiB)


def random_batch(rng: random.Random) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randrange(1, 40))] for _ in range(rng.randrange(1, 6))]
    params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), top_p=rng.choice([1.0, 0.9]),
                             seed=rng.choice([None, rng.randrange(1000)]), max_tokens=rng.randrange(1, 9),
                             stop_token_ids=rng.choice([None, [rng.randrange(3, 384)]]),
                             logprobs=rng.choice([None, 2]))
              for _ in prompts]
    return prompts, params


def test_rss_is_bounded_over_200_calls_with_forced_flips(model):
    rng = random.Random(2)
    with LLM(model=model, **ENGINE, world_size=2, flip_every_steps=4, num_kv_blocks=8) as llm, \
            deadline(240, f"{NUM_CALLS} generate calls"):
        pids = {"controller": None, **{f"rank {r}": p for r, p in enumerate(llm.stats()["rank_pids"])}}
        rss: dict[str, dict[int, int]] = {name: {} for name in pids}
        for call in range(1, NUM_CALLS + 1):
            prompts, params = random_batch(rng)
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert len(outs) == len(prompts) and all(o.finished for o in outs)
            if rng.random() < 0.2:
                llm.flip(rng.choice(["pp", "tp"]))
            stats = assert_settled(llm)
            if call in SAMPLED_CALLS:
                gc.collect()
                for name, pid in pids.items():
                    rss[name][call] = rss_bytes(pid or os.getpid())
    print(f"\n[rss over {NUM_CALLS} calls: {stats['steps']} steps, {stats['flips']} flips, "
          f"{stats['num_preemptions']} preemptions]")
    for name, by_call in rss.items():
        growth = by_call[NUM_CALLS] - by_call[10]
        print(f"  {name}: call 10 {by_call[10] / 2**20:.1f} MiB, call {NUM_CALLS} {by_call[NUM_CALLS] / 2**20:.1f} "
              f"MiB, peak of {len(by_call)} reads {max(by_call.values()) / 2**20:.1f} MiB, growth {growth / 2**20:+.1f} MiB")
    for name, by_call in rss.items():
        assert by_call[NUM_CALLS] - by_call[10] <= RSS_BOUND, f"{name} grew past the bound: {by_call}"
    assert stats["flips"] >= 100 and stats["num_preemptions"] > 0, "the run was meant to flip and preempt"


def test_nothing_is_left_after_any_kind_of_generate(model):
    """In process: stops of every kind, a refused batch, a failed step, an empty batch."""
    tok_text = "The quick brown fox jumps over the lazy dog"
    with LLM(model=model, **ENGINE, num_kv_blocks=12) as llm:
        cases = [
            ([tok_text] * 3, SamplingParams(temperature=0.0, max_tokens=30)),                   # EOS may stop
            ([tok_text], SamplingParams(temperature=0.0, max_tokens=40, stop=[" ", "e"])),      # stop strings
            ([[5, 6, 7]] * 8, SamplingParams(temperature=1.0, seed=3, max_tokens=100, ignore_eos=True)),
            ([[7] * 120], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)),  # max_model_len
            ([], None),
        ]
        for prompts, params in cases:
            llm.generate(prompts, params, use_tqdm=False)
            assert_settled(llm)
        with pytest.raises(ValueError, match=r"prompt 1: token id 999 is outside the vocabulary"):
            llm.generate([[5, 6], [999]], use_tqdm=False)
        assert_settled(llm)
        llm.ranks.call(ArmFault("step"))
        with pytest.raises(RankError, match=r"rank 0 failed: InjectedFault"):
            llm.generate([[5, 6, 7]] * 4, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        assert_settled(llm)
