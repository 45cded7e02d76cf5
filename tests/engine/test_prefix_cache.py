"""Automatic prefix caching (engine/prefix_cache.py, engine/blocks.py): fp32 greedy tokens equal HF's
with shared prefixes of every length relative to the block size, under preemption, under forced flips
on 2 and 3 ranks and across generate calls; a shared prefix is computed once; eviction keeps outputs
and never takes a block in use; seeded sampling is the same with caching on and off."""
import itertools
import random

import pytest

from phaseflip import LLM, SamplingParams
from phaseflip.engine.blocks import BlockAllocator
from phaseflip.engine.requests import Sequence
from phaseflip.engine.scheduler import Scheduler, SchedulerConfig
from tests.rank.test_layouts_parity import THREE_KV
from tests.models import compare_greedy, hf_greedy

BS = 16
NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def shared(prefix_len: int, suffix_lens, seed: int = 0, vocab: int = 384) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in suffix_lens]


# shorter than a block, exactly one block, a block and one token, several blocks, the whole prompt
PREFIXES = {"short": shared(5, [3, 20, 40]), "one_block": shared(BS, [1, 9, 30]),
            "block_and_one": shared(BS + 1, [2, 15, 33]), "three_blocks": shared(3 * BS + 4, [5, 17]),
            "whole_prompt": shared(2 * BS, [0, 0, 0]) + shared(BS + 5, [0, 0], seed=1)}
PROMPTS = [p for group in PREFIXES.values() for p in group]


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    d = tiny_model_dir("llama", **THREE_KV)
    return d, hf_greedy(d, PROMPTS, NEW)


def run(model_dir, prompts, calls: int = 1, **kw):
    """Each call generates all the prompts; returns the last call's token ids and the stats."""
    with LLM(model=str(model_dir), dtype="float32", max_num_seqs=8, **kw) as llm:
        for _ in range(calls):
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.stats()
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"], "blocks leaked (cached ones count as free)"
    return [o.outputs[0].token_ids for o in outs], stats


VARIANTS = {
    "one_rank": dict(),
    "two_calls": dict(calls=2),
    "preemption": dict(num_kv_blocks=14),
    "chunked_prefill": dict(max_num_batched_tokens=24),    # chunks that end inside a block
    "flip_every1_2ranks": dict(world_size=2, flip_every_steps=1, park="always"),
    "flip_every2_3ranks": dict(world_size=3, flip_every_steps=2),
    "flip_every3_2ranks": dict(world_size=2, flip_every_steps=3, calls=2),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_match_hf_with_caching_on(ref, variant):
    d, expected = ref
    kw = dict(VARIANTS[variant])
    ours, stats = run(d, PROMPTS, **kw)
    ok, ties, msg = compare_greedy(ours, expected)
    pc = stats["prefix_cache"]
    print(f"\n[prefix cache] {variant}: {msg}; {pc}; preemptions {stats['num_preemptions']}, "
          f"flips {stats['flips']}")
    assert ok, msg
    assert pc["prompt_tokens_reused"] > 0
    if variant == "preemption":
        assert stats["num_preemptions"] > 0
    if "flip_every_steps" in kw:
        assert stats["flips"] >= 2 and stats["failed_flips"] == 0
    if kw.get("calls") == 2:  # the second call reuses every whole block of the first (but the last token)
        reusable = sum((len(p) - 1) // BS * BS for p in PROMPTS)
        assert pc["prompt_tokens_reused"] >= reusable


def test_a_shared_prefix_is_computed_once(tiny_model_dir):
    """N prompts sharing a P-token prefix compute P + their suffixes (rounded to blocks), not N x P."""
    d = tiny_model_dir("llama", **THREE_KV)
    p, suffixes = 5 * BS + 3, [4, 11, 20, 7, 30, 1]
    prompts = shared(p, suffixes, seed=7)
    _, stats = run(d, prompts)
    pc = stats["prefix_cache"]
    reused_per_follower = p // BS * BS   # whole blocks of the prefix
    expected = sum(len(x) for x in prompts) - (len(prompts) - 1) * reused_per_follower
    assert pc["prompt_tokens_computed"] == expected, pc
    assert pc["prompt_tokens_computed"] < 2 * p + sum(suffixes)
    _, off = run(d, prompts, enable_prefix_caching=False)
    assert off["prefix_cache"] == {"enabled": False}


def test_eviction_under_pressure_keeps_outputs(tiny_model_dir):
    """A pool far smaller than the distinct prefixes: cached blocks are evicted (least recently freed
    first) and every output still matches HF."""
    d = tiny_model_dir("llama", **THREE_KV)
    prompts = [p for seed in range(6) for p in shared(2 * BS + 3, [4, 9], seed=100 + seed)]
    ours, stats = run(d, prompts, num_kv_blocks=16, calls=2)
    ok, _, msg = compare_greedy(ours, hf_greedy(d, prompts, NEW))
    assert ok, msg
    assert stats["prefix_cache"]["evictions"] > 0 and stats["prefix_cache"]["prompt_tokens_reused"] > 0


def test_seeded_sampling_is_the_same_with_caching_on_and_off(tiny_model_dir):
    d = tiny_model_dir("llama", **THREE_KV)
    prompts = shared(2 * BS + 5, [3, 8, 13, 21], seed=3)
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=40 + i, max_tokens=NEW, ignore_eos=True)
              for i in range(len(prompts))]
    got = {}
    for on in (True, False):
        with LLM(model=str(d), dtype="float32", max_num_seqs=8, enable_prefix_caching=on) as llm:
            llm.generate(prompts[:1], params[:1], use_tqdm=False)  # the second call hits the cache
            got[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            if on:
                assert llm.stats()["prefix_cache"]["prompt_tokens_reused"] > 0
    assert got[True] == got[False]


# -- the allocator and the scheduler alone (no torch) ---------------------------------------------

def drive(sched: Scheduler, steps: int = 10_000) -> int:
    """Run the scheduler with a fake executor (every sampled token is 7; a sequence finishes after 3);
    check after every step that each running sequence holds its blocks. Returns the prompt tokens
    the steps computed."""
    prompt_tokens = 0
    for _ in range(steps):
        plan = sched.schedule()
        if plan is None:
            break
        for c in plan.chunks:
            prompt_len = sched._live[c.seq_id].num_prompt_tokens
            prompt_tokens += max(0, min(c.start_pos + c.num_tokens, prompt_len) - c.start_pos)
        sched.on_step_done(plan, {c.seq_id: 7 for c in plan.chunks if c.sample})
        for seq in list(sched.running):
            assert all(b in sched.allocator._refs for b in seq.block_ids), "a running sequence lost a block"
            if seq.num_output_tokens >= 3:
                sched.finish(seq, "length")
    return prompt_tokens


def scheduler(num_blocks: int, caching: bool = True) -> Scheduler:
    alloc = BlockAllocator(num_blocks, BS, prefix_caching=caching)
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=64,
                                     block_size=BS), alloc)


_ids = itertools.count()


def add(sched, prompts) -> list[Sequence]:
    seqs = [Sequence(seq_id=next(_ids), request_id="r", prompt_token_ids=list(p),
                     params=SamplingParams()) for p in prompts]
    for seq in seqs:
        sched.add(seq)
    return seqs


@pytest.mark.parametrize("prefix_len", [5, BS, BS + 1, 3 * BS])
def test_scheduler_computes_a_shared_prefix_once(prefix_len):
    sched = scheduler(64)
    prompts = shared(prefix_len, [6, 6, 6, 6], seed=prefix_len)
    add(sched, prompts)
    whole = prefix_len // BS * BS
    assert drive(sched) == sum(len(p) for p in prompts) - 3 * whole
    assert sched.allocator.num_free_blocks == 64


def test_eviction_takes_plain_blocks_first_then_the_least_recently_freed_cached_one():
    sched = scheduler(8)
    add(sched, [shared(2 * BS + 1, [0], seed=1)[0]])
    drive(sched)
    alloc = sched.allocator
    assert alloc.cache.num_cached_blocks == 2 and alloc.num_free_blocks == 8
    cached = sorted(alloc._cached_free)
    got = alloc.allocate(6)                     # the 6 plain blocks: nothing evicted
    assert not set(got) & set(cached) and alloc.cache.evictions == 0
    assert cached == [0, 1]                     # the sequence's first two blocks
    assert alloc.allocate(1) == [1] and alloc.cache.evictions == 1   # its tail goes first
    with pytest.raises(RuntimeError, match="only 1 of 8 are free"):
        alloc.allocate(2)


def test_a_block_in_use_is_never_evicted():
    sched = scheduler(6)
    prompt = shared(2 * BS + 1, [0], seed=2)[0]
    add(sched, [prompt])
    drive(sched)                                 # 2 cached free blocks, 4 plain free
    seq, = add(sched, [prompt])
    plan = sched.schedule()                      # reuses both cached blocks: now in use
    assert seq.num_computed_tokens == 2 * BS and plan.chunks[0].start_pos == 2 * BS
    held = set(seq.block_ids)
    with pytest.raises(RuntimeError):
        sched.allocator.allocate(4)              # only the 3 plain blocks are free: none in use given out
    assert held <= set(sched.allocator._refs)


def test_caching_off_computes_every_token():
    sched = scheduler(64, caching=False)
    prompts = shared(3 * BS, [6, 6], seed=5)
    add(sched, prompts)
    assert drive(sched) == sum(len(p) for p in prompts) and sched.allocator.cache is None


def test_carried_blocks_are_each_block_once_and_the_cached_free_ones():
    sched = scheduler(16)
    prompt = shared(2 * BS + 1, [0], seed=4)[0]
    add(sched, [prompt])
    drive(sched)
    a, b = add(sched, [prompt, prompt])
    sched.schedule()
    carried = sched.allocator.carried_blocks()
    assert len(carried) == len(set(carried)) == len(set(a.block_ids) | set(b.block_ids))


def test_policy_inputs_do_not_count_a_cached_prefix_as_prefill_work():
    from phaseflip.engine.policy.terms import PolicyConfig
    from phaseflip.engine.policy.rules import PolicyRule
    from phaseflip.engine.sampling_params import SamplingParams as SP
    counts = {}
    for caching in (True, False):
        sched = scheduler(32, caching)
        prompt = shared(3 * BS + 2, [0], seed=9)[0]
        add(sched, [prompt])
        drive(sched)                                   # with caching: 3 blocks of the prompt stay cached
        waiting, = add(sched, [prompt + [5] * 7])
        waiting.params = SP(max_tokens=4)
        rule = PolicyRule(PolicyConfig(mode="throughput"), ("pp", "tp"), sched, max_model_len=256)
        inputs = rule._inputs("pp")
        counts[caching] = (inputs.pending_prefill_tokens, inputs.admissible_prefill_tokens, sched.uncached_tokens(waiting))
    n = 3 * BS + 2 + 7
    assert counts[False] == (n, n, n)
    assert counts[True] == (n - 3 * BS,) * 3
