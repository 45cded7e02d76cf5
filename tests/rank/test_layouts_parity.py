"""fp32 greedy parity with HF transformers over N ranks: PP and TP over 2 and 3 ranks, both layouts with
real flips (the drain rule), and forced flips every 1, 3 and 7 steps with a batch of mixed lengths.

The tiny models here have 3 KV heads (6 query heads) so that TP over 3 ranks is possible.
"""
import pytest

from phaseflip import LLM, SamplingParams
from tests.engine.test_parity import parity_prompts
from tests.matrix import cells
from tests.models import MOE_KINDS, WINDOW_KINDS, compare_greedy, hf_greedy

NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
THREE_KV = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3)

LAYOUTS = {
    "pp2": dict(world_size=2, layouts=("pp",)),
    "pp3": dict(world_size=3, layouts=("pp",)),
    "tp2": dict(world_size=2, layouts=("tp",)),
    "tp3": dict(world_size=3, layouts=("tp",)),
    "drain2": dict(world_size=2, park="always", policy="drain"),
    "drain3": dict(world_size=3, policy="drain"),
    "policy2": dict(world_size=2, park="always"),   # the default policy="throughput"
    "every1": dict(world_size=2, flip_every_steps=1, park="always"),
    "every3": dict(world_size=2, flip_every_steps=3),
    "every7": dict(world_size=3, flip_every_steps=7, park="always"),
}


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    cache = {}

    def get(kind):
        if kind not in cache:
            d = tiny_model_dir(kind, **THREE_KV)
            prompts = parity_prompts(384)[:6]  # 1 to 100 tokens
            cache[kind] = d, prompts, hf_greedy(d, prompts, NEW)
        return cache[kind]
    return get


def run(model_dir, prompts, **kw):
    with LLM(model=str(model_dir), dtype="float32", max_num_seqs=8, **kw) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.stats()
    assert stats["captures_after_boot"] == 0
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"]
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_llama_every_layout_matches_hf(ref, name):
    d, prompts, expected = ref("llama")
    ours, stats = run(d, prompts, **LAYOUTS[name])
    ok, ties, msg = compare_greedy(ours, expected)
    print(f"\n[parity] llama/{name}: {msg}; flips {stats['flips']}")
    assert ok, msg
    if "flip_every_steps" in LAYOUTS[name] or name.startswith("drain"):
        assert stats["flips"] >= 1 and stats["failed_flips"] == 0
        assert {e["direction"] for e in stats["flip_log"]} >= {"pp->tp"}


OTHER_KINDS = ("qwen2", "qwen3", "phi3", "qwen2window", "mistralwindow", "gemma2", "gemma3")


# Three TP ranks shard each family's parts by default: Qwen2's biases with Qwen2's window (qwen2window),
# Mistral's window with it too; three PP stages and flips every 3 steps run by default on Llama above
# (every family's PP and flips at 2 ranks: test_parity.py), and the windowed ones' flips here.
TP3_BY_DEFAULT = {"qwen3", "phi3", "qwen2window", "gemma2", "gemma3"}


@pytest.mark.parametrize("kind,name", cells(
    [(k, n) for k in OTHER_KINDS for n in ("tp3", "pp3", "every3")],
    default=lambda k, n: (n == "tp3" and k in TP3_BY_DEFAULT) or (n == "every3" and k in WINDOW_KINDS),
    why="a family holding the same parts runs this layout by default (Llama, Qwen2 with a window), and "
        "every family runs PP and flips at 2 ranks"))
def test_other_families_layouts_match_hf(ref, kind, name):
    """Phi-3 (q/k/v and gate/up fused in the file), windowed layers (Mistral's giving blocks back between
    flips), Gemma: HF's tokens over 3 ranks in each layout and with flips."""
    d, prompts, expected = ref(kind)
    ours, _ = run(d, prompts, **LAYOUTS[name])
    ok, ties, msg = compare_greedy(ours, expected)
    print(f"\n[parity] {kind}/{name}: {msg}")
    assert ok, msg


# Experts over 3 TP ranks by default on Qwen2-MoE (routed experts and the shared one; Qwen3-MoE's q/k norms
# run in qwen3's cell); whole MoE layers in 3 stages and a flip every step at 2 ranks are Llama's PP path
# here and test_parity.py's two-rank flipping test for each MoE family.
@pytest.mark.parametrize("kind,name", cells(
    [(k, n) for k in MOE_KINDS for n in ("tp3", "pp3", "every1")],
    default=lambda k, n: n == "tp3" and k == "qwen2moe",
    why="the same path runs by default: experts over 3 TP ranks on Qwen2-MoE, PP3 on Llama, a flip every "
        "step at 2 ranks in test_parity.py"))
def test_mixtures_of_experts_match_hf_in_every_layout(ref, kind, name):
    """Experts sharded like the MLP over 3 TP ranks (32 columns: 11/11/10), whole layers in PP, and a
    flip every step at 2 ranks: HF's tokens."""
    d, prompts, expected = ref(kind)
    ours, stats = run(d, prompts, **LAYOUTS[name])
    ok, ties, msg = compare_greedy(ours, expected)
    print(f"\n[parity] {kind}/{name}: {msg}; flips {stats['flips']}")
    assert ok, msg
    if name == "every1":
        assert stats["flips"] >= NEW and stats["failed_flips"] == 0


def test_smollm2_two_ranks_uneven_tp_with_real_flips(smollm_reference):
    """SmolLM2: 3 KV heads over 2 ranks is the uneven [2, 1] TP split with PP layers [20, 10]."""
    default_model_dir, prompts, expected = smollm_reference
    with LLM(model=str(default_model_dir), dtype="float32", max_num_seqs=8, max_model_len=512,
             world_size=2, park="always", flip_every_steps=5) as llm:
        plan = llm.plan.layout_plan
        assert plan.kv_heads == (2, 1) and plan.layers == (20, 10)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                            use_tqdm=False)
        stats = llm.stats()
    ok, ties, msg = compare_greedy([o.outputs[0].token_ids for o in outs], expected)
    print(f"\n[parity] smollm2/world2 flips every 5: {msg}; flips {stats['flips']}")
    assert ok, msg
    assert stats["flips"] >= 4 and stats["captures_after_boot"] == 0


@pytest.mark.parametrize("world_size", [2, 3])
def test_pp_micro_batches_match_hf(ref, world_size):
    """PP steps cut into micro-batches (micro_batches.py): the first 512-token prefill step in pieces of
    128 (chunks straddling the cuts), 32-sequence decodes in pieces of 16: HF's tokens, every sequence."""
    d, _, _ = ref("llama")
    prompts = parity_prompts(384)          # 1 to 200 tokens, 569 in all
    expected = hf_greedy(d, prompts, NEW)
    with LLM(model=str(d), dtype="float32", max_num_seqs=32, world_size=world_size, layouts=("pp",)) as llm:
        outs = llm.generate(prompts * 4, GREEDY, use_tqdm=False)
        stats = llm.stats()
    ok, ties, msg = compare_greedy([o.outputs[0].token_ids for o in outs], expected * 4)
    print(f"\n[parity] llama/pp{world_size} micro-batches: {msg}; {stats['micro_batched_runs']}")
    assert ok, msg
    assert stats["micro_batched_runs"].get("pp:prefill", 0) >= 1
    assert stats["micro_batched_runs"].get("pp:decode", 0) >= 1
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"]
