"""The policy end to end on the CPU: 2 ranks, SmolLM2, 64 prompts of mixed length. Every request
completes, greedy outputs equal a single-rank run, and flips stay within 2 per drain cycle."""
import math
import random

import pytest

from phaseflip import LLM, SamplingParams

pytestmark = pytest.mark.slow

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly box jugs of gold".split()
MAX_NUM_SEQS = 16


def test_policy_end_to_end_two_ranks(default_model_dir):
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))) for _ in range(64)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(4, 16), ignore_eos=True) for _ in prompts]
    kw = dict(model=str(default_model_dir), max_model_len=256, max_num_seqs=MAX_NUM_SEQS)
    with LLM(**kw) as single:
        expected = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    with LLM(world_size=2, park="always", **kw) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    assert all(o.finished for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == expected
    drain_cycles = math.ceil(len(prompts) / MAX_NUM_SEQS)
    print(f"\n[policy e2e] flips {stats['flips']} for {drain_cycles} drain cycles; "
          f"{len(stats['decisions'])} distinct decisions")
    assert stats["flips"] <= 2 * drain_cycles
    assert stats["decisions"], "every decision is logged"
    assert all(set(d) >= {"time_s", "layout", "action", "reason", "numbers"} for d in stats["decisions"])
