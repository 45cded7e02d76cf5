"""Determinism: the same batch twice gives identical outputs (greedy and seeded,
over flips), and a request's output does not depend on which other requests share its batch: greedy
fp32 tokens equal the single-rank reference alone, and seeded ones equal their own run alone, on 2
ranks flipping between PP and TP (TP reduces partial sums across ranks)."""
from __future__ import annotations

import random

import pytest

from phaseflip import LLM, SamplingParams
from tests.reliability.support import ENGINE, deadline, greedy, ids

NEW = 16


@pytest.fixture(scope="module")
def flipping(model):
    with LLM(model=model, **ENGINE, world_size=2, flip_every_steps=3) as llm:
        yield llm


def mixed_batch(seed: int, n: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randrange(1, 70))] for _ in range(n)]
    params = [greedy(NEW) if rng.random() < 0.5 else
              SamplingParams(temperature=rng.choice([0.6, 1.0]), top_p=rng.choice([0.8, 1.0]),
                             top_k=rng.choice([0, 20]), seed=rng.randrange(10**6), max_tokens=NEW,
                             ignore_eos=True)
              for _ in range(n)]
    return prompts, params


def test_the_same_batch_twice_gives_identical_outputs(flipping, reference):
    prompts, params = mixed_batch(0, 12)
    with deadline(120, "two runs of a batch"):
        first = flipping.generate(prompts, params, use_tqdm=False)
        second = flipping.generate(prompts, params, use_tqdm=False)
    assert ids(first) == ids(second)
    assert [o.outputs[0].text for o in first] == [o.outputs[0].text for o in second]
    greedy_at = [i for i, p in enumerate(params) if p.greedy]
    assert [ids(first)[i] for i in greedy_at] == reference([prompts[i] for i in greedy_at], NEW)


def test_outputs_do_not_depend_on_the_other_requests_in_the_batch(flipping, reference):
    targets, target_params = mixed_batch(1, 4)
    with deadline(180, "targets alone and in five batches"):
        alone = [ids(flipping.generate([p], sp, use_tqdm=False))[0] for p, sp in zip(targets, target_params)]
        for seed in range(2, 7):
            others, other_params = mixed_batch(seed, random.Random(seed).randrange(1, 8))
            order = random.Random(seed).sample(range(len(others) + len(targets)), len(others) + len(targets))
            batch = [(others + targets)[i] for i in order]
            params = [(other_params + target_params)[i] for i in order]
            got = ids(flipping.generate(batch, params, use_tqdm=False))
            for t, out in zip(range(len(targets)), alone):
                assert got[order.index(len(others) + t)] == out, f"target {t} changed with batch seed {seed}"
    greedy_at = [i for i, p in enumerate(target_params) if p.greedy]
    assert [alone[i] for i in greedy_at] == reference([targets[i] for i in greedy_at], NEW)
    assert flipping.stats()["flips"] > 10
