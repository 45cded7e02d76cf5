"""fp32 greedy parity with HF transformers on the same weights: token ids identical.

A divergence is forgiven only from a position where the reference's top-2 log-probabilities differ by
less than 1e-4 (vLLM's check_logprobs_close convention); how often that happened is printed (-s).
Each model runs batched; one prompt at a time, with a 16-token prefill chunk, and with a KV pool small
enough to force preemption (asserted) on the families those paths meet differently by default, on every
family under `make test-slow` (tests/matrix.py); SmolLM2 batched and in 16-token chunks by default.
"""
import random

import pytest

from phaseflip import LLM, SamplingParams
from phaseflip.kernels.cpu import fused_layer, library
from tests.matrix import cells
from tests.models import KINDS, compare_greedy, hf_greedy

NEW_TOKENS = 32
LENGTHS = (1, 5, 17, 32, 64, 100, 150, 200)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

VARIANTS = {
    "batched": dict(),
    "alone": dict(),                       # one generate() call per prompt
    "chunk16": dict(max_num_batched_tokens=16),
    # 30 blocks of 16 tokens: far less than 8 sequences of up to 232 tokens need at once.
    "preempt": dict(num_kv_blocks=30),
}


def parity_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in LENGTHS]


def run_engine(model_dir, prompts, variant: str, **engine_kw):
    kw = {"max_num_seqs": 8, **VARIANTS[variant], **engine_kw}
    with LLM(model=str(model_dir), dtype="float32", **kw) as llm:
        if variant == "alone":
            outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
        else:
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.stats()
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"], "blocks leaked"
    if variant == "preempt":
        assert stats["num_preemptions"] > 0, "the small pool was meant to force preemption"
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    cache = {}

    def get(kind):
        if kind not in cache:
            model_dir = tiny_model_dir(kind)
            prompts = parity_prompts(384)
            cache[kind] = (model_dir, prompts, hf_greedy(model_dir, prompts, NEW_TOKENS))
        return cache[kind]
    return get


TINY_KINDS = ("llama", "qwen2", "qwen3", "mistral", "llama3rope", "linearrope", "yarnrope", "phi3", "mixtral",
              "qwen2moe", "qwen3moe", "mistralwindow", "qwen2window", "gemma2", "gemma3")
# Past a batch, the scheduler's variants on the families whose attention or KV they meet differently:
# chunks over windows, soft caps and a shared expert; a pool that preempts windowed sequences.
VARIANT_KINDS = {"batched": set(TINY_KINDS), "alone": {"llama"},
                 "chunk16": {"llama", "mistralwindow", "qwen2window", "gemma2", "gemma3", "qwen2moe"},
                 "preempt": {"llama", "mistralwindow", "qwen2window", "gemma3"}}
# Two ranks, a flip every step: the families that shard differently (biases, q/k norms, fused
# projections, experts, windows, Gemma); the rope variants and Mistral shard as Llama does.
FLIPPING_KINDS = {"llama", "qwen2", "qwen3", "phi3", "mixtral", "qwen2moe", "qwen3moe", "mistralwindow",
                  "qwen2window", "gemma2", "gemma3"}


@pytest.mark.parametrize("kind,variant", cells(
    [(k, v) for v in VARIANTS for k in TINY_KINDS], default=lambda k, v: k in VARIANT_KINDS[v],
    why="this variant's path runs by default on the families that meet it differently"))
def test_tiny_models_match_hf(references, kind, variant):
    model_dir, prompts, ref = references(kind)
    # a window on every layer gives blocks back as sequences decode: only a smaller pool still preempts
    windowed = kind == "mistralwindow" and variant == "preempt"
    extra = dict(num_kv_blocks=16, max_num_batched_tokens=16) if windowed else {}
    ours = run_engine(model_dir, prompts, variant, **extra)
    ok, ties, msg = compare_greedy(ours, ref)
    print(f"\n[parity] {kind}/{variant}: {msg}")
    assert ok, msg


@pytest.mark.parametrize("kind", cells(                       # phi3longrope: its 128 positions, below
    [k for k in KINDS if k != "phi3longrope"], default=FLIPPING_KINDS,
    why="shards as Llama does, which runs by default"))
def test_two_ranks_flipping_every_step_give_the_same_tokens(references, kind):
    """Every family and feature at 2 ranks, parked images, the layout flipped at every step (KV resharded,
    weights refilled): HF's tokens, the same 8 prompts x 32 tokens as one rank."""
    model_dir, prompts, ref = references(kind)
    with LLM(model=str(model_dir), dtype="float32", max_num_seqs=8, world_size=2, flip_every_steps=1,
             park="always") as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.stats()
    ok, ties, msg = compare_greedy([o.outputs[0].token_ids for o in outs], ref)
    print(f"\n[parity] {kind}/2 ranks, a flip every step: {msg}; flips {stats['flips']}")
    assert ok, msg
    assert stats["flips"] >= NEW_TOKENS and stats["failed_flips"] == 0
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"]


@pytest.mark.parametrize("variant", cells(
    list(VARIANTS), default={"batched", "chunk16"},
    why="the tiny models run this scheduling by default, and SmolLM2's one-row steps run in "
        "test_smollm2_fused_layers_match_hf"))
def test_smollm2_matches_hf(smollm_reference, variant):
    model_dir, prompts, ref = smollm_reference
    extra = dict(num_kv_blocks=12) if variant == "preempt" else {}
    ours = run_engine(model_dir, prompts, variant, max_model_len=512, **extra)
    ok, ties, msg = compare_greedy(ours, ref)
    print(f"\n[parity] smollm2/{variant}: {msg}")
    assert ok, msg


@pytest.fixture
def fused_forced(monkeypatch) -> list:
    """Batch-1 steps through the fused layers (kernels/cpu/fused_layer.py) whatever the boot measured (a tiny
    model's one-row products may measure faster in another form); the list counts the fused calls."""
    if library.decode_layers_op() is None:
        pytest.skip(f"no CPU kernels here: {library.kernel_report()['reason']}")
    calls, run = [], fused_layer.decoder_layers
    monkeypatch.setattr(fused_layer, "_why_not", lambda dtype, tp_size, plain=True: None if plain else "MoE")
    monkeypatch.setattr(fused_layer, "decoder_layers", lambda *a: calls.append(1) or run(*a))
    return calls


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_fused_layers_match_hf(references, kind, fused_forced):
    model_dir, prompts, ref = references(kind)
    ok, ties, msg = compare_greedy(run_engine(model_dir, prompts, "alone"), ref)
    print(f"\n[parity] {kind}/fused: {msg}")
    assert ok, msg
    assert len(fused_forced) >= len(prompts) * (NEW_TOKENS - 1), "batch-1 decode steps ran fused"


def test_smollm2_fused_layers_match_hf(smollm_reference, fused_forced):
    model_dir, prompts, ref = smollm_reference
    ok, ties, msg = compare_greedy(run_engine(model_dir, prompts, "alone", max_model_len=512), ref)
    print(f"\n[parity] smollm2/fused: {msg}")
    assert ok, msg
    assert len(fused_forced) >= len(prompts) * (NEW_TOKENS - 1), "batch-1 decode steps ran fused"


@pytest.mark.parametrize("kind", ["mistralwindow", "qwen2window"])
def test_windowed_models_give_back_what_every_window_has_left(references, kind):
    """Mistral's window on every layer: a sequence's blocks behind it return to the pool while it decodes
    (a pool of 20 blocks serves 8 sequences of up to 232 tokens); Qwen2's layer 0 attends everything,
    so nothing returns. HF's tokens either way."""
    model_dir, prompts, ref = references(kind)
    kw = dict(max_num_seqs=8, num_kv_blocks=20) if kind == "mistralwindow" else dict(max_num_seqs=8)
    with LLM(model=str(model_dir), dtype="float32", **kw) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.stats()
    ok, ties, msg = compare_greedy([o.outputs[0].token_ids for o in outs], ref)
    print(f"\n[parity] {kind}: {msg}; window_freed_blocks {stats['window_freed_blocks']}, "
          f"preemptions {stats['num_preemptions']}")
    assert ok, msg
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"]
    assert (stats["window_freed_blocks"] > 0) == (kind == "mistralwindow")


def test_a_windowed_model_runs_sequences_longer_than_the_pool(references):
    """Mistral's 24-token window on every layer, 32-token chunks, blocks of 16: a sequence holds at most
    5 blocks at once, so a pool of 6 serves sequences of up to 232 tokens (15 blocks) to their end, with
    HF's tokens; with every block counted they would end at 96 tokens."""
    model_dir, prompts, ref = references("mistralwindow")
    with LLM(model=str(model_dir), dtype="float32", max_num_seqs=1, num_kv_blocks=6,
             max_num_batched_tokens=32) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.stats()
    ok, ties, msg = compare_greedy([o.outputs[0].token_ids for o in outs], ref)
    assert ok, msg
    assert max(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs) > 6 * 16
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"] == 6


@pytest.mark.parametrize("ranks", [dict(), dict(world_size=2, flip_every_steps=1, park="always")])
@pytest.mark.parametrize("kind", ["dynamicrope", "phi3longrope"])
def test_scaled_ropes_match_hf_within_the_context_they_serve(tiny_model_dir, kind, ranks):
    """Dynamic NTK within max_position_embeddings (transformers changes nothing there) and LongRoPE within
    its original 128 positions (the short factors and the attention factor): HF's tokens, prompts of 1-100
    tokens and 24 new ones (at most 124 positions), on one rank and on two flipping at every step."""
    model_dir, prompts = tiny_model_dir(kind), parity_prompts(384)[:6]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(model=str(model_dir), dtype="float32", max_num_seqs=8, **ranks) as llm:
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    ok, ties, msg = compare_greedy(ours, hf_greedy(model_dir, prompts, 24))
    print(f"\n[parity] {kind}: {msg}")
    assert ok, msg
