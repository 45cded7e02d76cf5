"""Replay equals eager, token for token: an LLM with captured buckets against enforce_eager=True.

Greedy fp32 on tiny random models. Each scenario's batch is sized to hit a bucket exactly, to be padded
up to one, or to run above the largest (an eager fallback); the registry's replay counters and the
eager-fallback counters are checked to prove which path each step really took. World size 1: the
single rank runs in-process (llm.ranks.runtime), in the "pp" layout. The engines are shared
by the whole module, so later scenarios also run over buffers left dirty by earlier ones (stale rows,
wider block tables), which is what padding must cope with.
"""
import random

import pytest

from phaseflip import LLM, SamplingParams

KINDS = ["llama", "qwen3"]
NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
D = NEW_TOKENS - 1   # decode steps after the prefill step that samples the first token

CONFIGS = {
    "main": dict(max_num_seqs=16, max_num_batched_tokens=512, decode_buckets=(1, 2, 4, 8),
                 prefill_buckets=(32, 64, 128)),
    # chunked prefill (64-token budget) and mixed prefill+decode steps
    "chunked": dict(max_num_seqs=8, max_num_batched_tokens=64, decode_buckets=(1, 2, 4, 8),
                    prefill_buckets=(32, 64)),
    # 14 blocks of 16 tokens for four sequences of up to 140 tokens: forces preemption (recompute)
    "preempt": dict(max_num_seqs=8, max_num_batched_tokens=64, decode_buckets=(1, 2, 4, 8),
                    prefill_buckets=(32, 64), num_kv_blocks=14),
}
# The expected buckets count every prompt token: the scenarios share one engine, and two of them draw
# prompts from the same seed (a shared prefix that prefix caching would not compute again).
for _c in CONFIGS.values():
    _c["enable_prefix_caching"] = False
NUM_BUCKETS = {name: len(c["decode_buckets"]) + len(c["prefill_buckets"]) for name, c in CONFIGS.items()}

# name -> (config, prompt lengths, max_tokens per prompt or None, replays per (phase, bucket),
#          eager fallbacks per phase); None = not asserted exactly
SCENARIOS = {
    "exact-1seq-32tok": ("main", [32], None, {("prefill", 32): 1, ("decode", 1): D}, {}),
    "exact-2seqs-64tok": ("main", [32, 32], None, {("prefill", 64): 1, ("decode", 2): D}, {}),
    "exact-4seqs-128tok": ("main", [32] * 4, None, {("prefill", 128): 1, ("decode", 4): D}, {}),
    "exact-8seqs-128tok": ("main", [16] * 8, None, {("prefill", 128): 1, ("decode", 8): D}, {}),
    "padded-3seqs-40tok": ("main", [10, 15, 15], None, {("prefill", 64): 1, ("decode", 4): D}, {}),
    "padded-1seq-40tok": ("main", [40], None, {("prefill", 64): 1, ("decode", 1): D}, {}),
    "padded-5seqs-30tok": ("main", [6] * 5, None, {("prefill", 32): 1, ("decode", 8): D}, {}),
    "padded-7seqs-100tok": ("main", [20, 20, 20, 10, 10, 10, 10], None,
                            {("prefill", 128): 1, ("decode", 8): D}, {}),
    "above-12seqs-240tok": ("main", [20] * 12, None, {},
                            {"prefill": 1, "decode": D}),
    "above-1seq-300tok": ("main", [300], None, {("decode", 1): D}, {"prefill": 1}),
    # 16 running + 1 waiting; seq 0 stops after 2 tokens, so seq 16 is admitted into a step that
    # mixes 15 decodes with its 8-token prefill (23 tokens over 16 sequences: prefill bucket 32).
    "mixed-17seqs": ("main", [8] * 17, [2] + [NEW_TOKENS] * 16,
                     {("prefill", 128): 1, ("prefill", 32): 1, ("decode", 1): 2},
                     {"decode": 4}),
    # 150 tokens in chunks 64, 64, 22(+42 of seq 1), then a step of 1 decode + 28 + 5 prefill tokens
    "chunked-3seqs": ("chunked", [150, 70, 5], [8] * 3,
                      {("prefill", 64): 4, ("decode", 4): 6, ("decode", 2): 1}, {}),
    "preempt-4seqs": ("preempt", [100, 60, 50, 40], [40] * 4, None, {}),
}


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """(kind, config) -> (captured LLM, eager LLM, buffer addresses at boot); built once per module."""
    cache = {}

    def get(kind: str, config: str):
        if (kind, config) not in cache:
            # 512 positions so that a 300-token prompt (above every prefill bucket) fits
            model_dir = str(tiny_model_dir(kind, max_position_embeddings=512))
            kw = dict(model=model_dir, dtype="float32", **CONFIGS[config])
            captured, eager = LLM(**kw), LLM(enforce_eager=True, **kw)
            ptrs = {k: t.data_ptr() for k, t in _runtime(captured).buffers.tensors.items()}
            cache[(kind, config)] = (captured, eager, ptrs)
        return cache[(kind, config)]

    yield get
    for captured, eager, _ in cache.values():
        captured.shutdown()
        eager.shutdown()


def _runtime(llm):
    """The in-process rank of a world-size-1 LLM: its registry and static buffers."""
    return llm.ranks.runtime


def _replays(llm) -> dict[tuple[str, int], int]:
    return {(s.key.phase, s.key.bucket): s.replays for s in _runtime(llm).registry.steps()}


def _fallbacks(llm) -> dict[str, int]:
    """Eager fallbacks per phase ("prefill" | "decode") of the active layout."""
    stats = llm.stats()
    prefix = stats["active_layout"] + ":"
    assert all(k.startswith(prefix) for k in stats["eager_fallbacks"]), stats["eager_fallbacks"]
    return {k.removeprefix(prefix): v for k, v in stats["eager_fallbacks"].items()}


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def _prompts(lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in lengths]


def _generate(llm, prompts, max_tokens):
    params = GREEDY if max_tokens is None else [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"], "blocks leaked"
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("kind", KINDS)
def test_replay_matches_eager(engines, kind, scenario):
    config, lengths, max_tokens, want_replays, want_fallbacks = SCENARIOS[scenario]
    captured, eager, _ = engines(kind, config)
    prompts = _prompts(lengths, seed=len(scenario))
    replays0, fallbacks0 = _replays(captured), _fallbacks(captured)
    preempt0 = captured.stats()["num_preemptions"]

    ours = _generate(captured, prompts, max_tokens)
    ref = _generate(eager, prompts, max_tokens)

    assert ours == ref, f"{kind}/{scenario}: replayed tokens differ from eager"
    assert [len(t) for t in ours] == (max_tokens or [NEW_TOKENS] * len(prompts))
    replays = _delta(_replays(captured), replays0)
    fallbacks = _delta(_fallbacks(captured), fallbacks0)
    if want_replays is not None:
        assert replays == want_replays, f"replays per (phase, bucket): {replays}"
        assert fallbacks == want_fallbacks, f"eager fallbacks: {fallbacks}"
    else:
        assert sum(replays.values()) > 0 and fallbacks == {}
    if config == "preempt":
        assert captured.stats()["num_preemptions"] > preempt0, "the small pool was meant to preempt"
    stats = captured.stats()
    assert stats["captures_after_boot"] == 0
    assert stats["captures_at_boot"] == NUM_BUCKETS[config]


@pytest.mark.parametrize("kind", KINDS)
def test_buffers_stay_put_and_nothing_is_captured_after_boot(engines, kind):
    captured, eager, ptrs = engines(kind, "main")
    _generate(captured, _prompts([10, 15, 15], seed=1), None)     # padded
    _generate(captured, _prompts([300], seed=2), None)            # above the largest prefill bucket
    rt = _runtime(captured)
    assert {k: t.data_ptr() for k, t in rt.buffers.tensors.items()} == ptrs, "static buffers moved"
    for step in rt.registry.steps():
        assert step.backend == "eager"
        for name, view in step.views.items():
            assert view.data_ptr() == ptrs[name], f"{step.key}: view {name} is not the static buffer"
    assert {s.key.layout for s in rt.registry.steps()} == {captured.stats()["active_layout"]}
    assert sorted((s.key.phase, s.key.bucket) for s in rt.registry.steps()) == [
        ("decode", 1), ("decode", 2), ("decode", 4), ("decode", 8),
        ("prefill", 32), ("prefill", 64), ("prefill", 128)]
    stats = captured.stats()
    assert stats["captures_at_boot"] == 7 and stats["captures_after_boot"] == 0
    assert _fallbacks(captured).get("prefill", 0) >= 1
    assert eager.stats()["captures_at_boot"] == 0 and len(_runtime(eager).registry) == 0
