"""The planner: budgets -> PP layer ranges and TP head/MLP/vocab shares, and the KV block arithmetic."""
import random
import subprocess
import sys
from dataclasses import replace
from fractions import Fraction

import pytest

from phaseflip.rank.model_config import ModelConfig
from phaseflip.rank.planner import (LayoutPlan, LayoutSpec, kv_block_bytes, plan_layouts,
                                       proportional_split, usable_blocks)
from phaseflip.rank.shard import RankShard, Span

HETERO = [31.8, 18.8, 19.8]  # GiB of three unequal cards


def make_cfg(num_layers=30, num_heads=9, num_kv_heads=3, intermediate=1536, vocab=49152, head_dim=64):
    """SmolLM2-135M by default."""
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=num_heads * head_dim,
                       intermediate_size=intermediate, num_layers=num_layers, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=1e5,
                       max_position_embeddings=2048, tie_word_embeddings=True)


SMOL = make_cfg()
LLAMA8 = make_cfg(num_layers=32, num_heads=32, num_kv_heads=8, intermediate=14336, vocab=128256, head_dim=128)


def spans(shards, field):
    return [(getattr(s, field).start, getattr(s, field).count) for s in shards]


def assert_well_formed(plan, cfg):
    """Invariants every plan must hold, whatever the split."""
    n = plan.world_size
    assert sum(plan.kv_heads) == cfg.num_kv_heads and min(plan.kv_heads) >= 1
    assert sum(plan.layers) == cfg.num_layers and min(plan.layers) >= 1
    assert plan.balanced == all(l * cfg.num_kv_heads == k * cfg.num_layers
                                for k, l in zip(plan.kv_heads, plan.layers))
    assert plan.balanced == (not any("minimum over ranks and views" in note for note in plan.notes))
    for field, total in (("mlp", cfg.intermediate_size), ("vocab", cfg.vocab_size),
                         ("kv_heads", cfg.num_kv_heads)):
        got = spans(plan.tp.shards, field)
        assert got[0][0] == 0 and sum(c for _, c in got) == total and min(c for _, c in got) >= 1
        assert all(a + c == b for (a, c), (b, _) in zip(got, got[1:]))
    pp_layers = spans(plan.pp.shards, "layers")
    assert pp_layers[0][0] == 0 and all(a + c == b for (a, c), (b, _) in zip(pp_layers, pp_layers[1:]))
    for r, s in enumerate(plan.pp.shards):
        assert (s.has_embed, s.has_head, s.tp_size) == (r == 0, r == n - 1, 1)
        assert (s.kv_heads, s.mlp, s.vocab) == (Span(0, cfg.num_kv_heads), Span(0, cfg.intermediate_size),
                                                Span(0, cfg.vocab_size))
    for s in plan.tp.shards:
        assert (s.has_embed, s.has_head, s.tp_size, s.layers) == (True, True, n, Span(0, cfg.num_layers))
    assert plan.pp.output_rank == plan.tp.output_rank == n - 1


# --- the required examples -------------------------------------------------------------------------------

def test_smollm2_over_two_equal_ranks_is_kv_2_1_and_layers_20_10():
    plan = plan_layouts(SMOL, [1.0, 1.0])
    assert (plan.kv_heads, plan.layers, plan.balanced) == ((2, 1), (20, 10), True)
    assert spans(plan.pp.shards, "layers") == [(0, 20), (20, 10)]
    assert spans(plan.tp.shards, "kv_heads") == [(0, 2), (2, 1)]
    assert [s.q_heads(SMOL) for s in plan.tp.shards] == [Span(0, 6), Span(6, 3)]
    assert spans(plan.tp.shards, "mlp") == [(0, 1024), (1024, 512)]
    assert spans(plan.tp.shards, "vocab") == [(0, 32768), (32768, 16384)]
    assert any("rounded to [2, 1]" in note for note in plan.notes)  # why rank 0 holds more than half
    assert_well_formed(plan, SMOL)


def test_smollm2_over_three_equal_ranks_is_one_head_and_ten_layers_each():
    plan = plan_layouts(SMOL, [24e9] * 3)
    assert (plan.kv_heads, plan.layers, plan.balanced, plan.notes) == ((1, 1, 1), (10, 10, 10), True, ())
    assert spans(plan.tp.shards, "mlp") == [(0, 512), (512, 512), (1024, 512)]
    assert_well_formed(plan, SMOL)


def test_five_layers_two_kv_heads_cannot_balance_and_the_tie_goes_to_rank_0():
    cfg = make_cfg(num_layers=5, num_heads=4, num_kv_heads=2)
    plan = plan_layouts(cfg, [1, 1])
    assert (plan.kv_heads, plan.layers, plan.balanced) == ((1, 1), (3, 2), False)
    (note,) = plan.notes
    assert "rank 0 (3/5 layers vs 1/2 kv heads)" in note and "rank 1 (2/5 layers vs 1/2 kv heads)" in note
    assert "minimum over ranks and views" in note
    assert_well_formed(plan, cfg)


def test_heterogeneous_budgets_split_by_largest_remainder():
    plan = plan_layouts(LLAMA8, HETERO)  # quotas 3.61, 2.14, 2.25 -> floors 3,2,2, the spare head to rank 0
    assert (plan.kv_heads, plan.layers, plan.balanced) == ((4, 2, 2), (16, 8, 8), True)
    assert spans(plan.tp.shards, "mlp") == [(0, 7168), (7168, 3584), (10752, 3584)]
    assert_well_formed(plan, LLAMA8)
    assert plan_layouts(SMOL, HETERO).kv_heads == (1, 1, 1)


def test_one_rank_holds_everything_and_both_layouts_are_the_same():
    plan = plan_layouts(SMOL, [7.5])
    assert plan.pp.shards == plan.tp.shards == (RankShard.full(SMOL),)
    assert (plan.kv_heads, plan.layers, plan.balanced, plan.notes) == ((3,), (30,), True, ())
    assert plan.pp.output_rank == 0


def test_block_formats_keep_each_cut_row_of_o_proj_and_down_proj_in_whole_blocks():
    """GGUF blocks: o_proj rows are cut at head boundaries, down_proj rows within the MLP, each on its own
    format's blocks (SmolLM2's Q4_K_M: Q5_0's 32 and Q4_K's 256); a block a cut cannot follow is refused
    by projection, naming the layout that can serve it."""
    plan = plan_layouts(SMOL, [1.0, 1.0], column_units=(32, 256))
    assert spans(plan.tp.shards, "mlp") == [(0, 1024), (1024, 512)]   # 4 and 2 blocks of 256
    assert spans(plan_layouts(SMOL, [1.0, 1.0, 1.0], column_units=(32, 256)).tp.shards, "mlp") == [
        (0, 512), (512, 512), (1024, 512)]
    assert spans(plan_layouts(SMOL, [2.0, 1.0], column_units=(1, 512)).tp.shards, "mlp") == [(0, 1024), (1024, 512)]
    with pytest.raises(ValueError, match=r"o_proj at head boundaries \(64 values\), which its 256-value blocks "
                                         r"cannot follow; serve this model with layouts=\('pp',\)"):
        plan_layouts(SMOL, [1.0, 1.0], column_units=(256, 256))
    with pytest.raises(ValueError, match="down_proj within the MLP's 1536 columns, which its 1024-value blocks"):
        plan_layouts(SMOL, [1.0, 1.0], column_units=(32, 1024))
    assert plan_layouts(SMOL, [1.0], column_units=(256, 1024)).tp.shards == (RankShard.full(SMOL),)


def test_fewer_kv_heads_than_ranks_is_refused():
    with pytest.raises(ValueError, match="3 KV heads cannot be split over 4 tensor-parallel ranks; "
                                         "use world_size <= 3 for now"):
        plan_layouts(SMOL, [1] * 4)


def test_fewer_layers_than_ranks_is_refused():
    cfg = make_cfg(num_layers=2, num_heads=4, num_kv_heads=4)
    with pytest.raises(ValueError, match="2 layers cannot be split over 3 pipeline stages.*world_size <= 2"):
        plan_layouts(cfg, [1] * 3)


# --- explicit splits ---------------------------------------------------------------------------------------

def test_explicit_pp_split_is_honoured_and_kv_derived_from_it():
    plan = plan_layouts(SMOL, [1, 1], pp_split=[10, 20])
    assert (plan.layers, plan.kv_heads, plan.balanced) == ((10, 20), (1, 2), True)
    skewed = plan_layouts(SMOL, [1, 1], pp_split=[25, 5])  # kv quotas 2.5, 0.5 -> [2, 1]
    assert (skewed.layers, skewed.kv_heads, skewed.balanced) == ((25, 5), (2, 1), False)
    assert_well_formed(skewed, SMOL)


def test_explicit_tp_kv_split_is_honoured_and_layers_derived_from_it():
    plan = plan_layouts(LLAMA8, HETERO, tp_kv_split=[2, 3, 3])
    assert (plan.kv_heads, plan.layers, plan.balanced) == ((2, 3, 3), (8, 12, 12), True)
    assert_well_formed(plan, LLAMA8)


def test_both_explicit_splits_are_kept_even_when_unbalanced():
    plan = plan_layouts(SMOL, [1, 1], pp_split=[15, 15], tp_kv_split=[2, 1])
    assert (plan.layers, plan.kv_heads, plan.balanced) == ((15, 15), (2, 1), False)
    assert_well_formed(plan, SMOL)


@pytest.mark.parametrize("kwargs, match", [
    (dict(pp_split=[20, 9]), r"pp_split=\[20, 9\] sums to 29 but must sum to num_layers=30"),
    (dict(pp_split=[30, 0]), r"pp_split\[1\]=0 must be an int >= 1"),
    (dict(pp_split=[10, 10, 10]), r"pp_split=\[10, 10, 10\] has 3 entries but world_size is 2"),
    (dict(pp_split=[20.0, 10]), r"pp_split\[0\]=20.0 must be an int >= 1"),
    (dict(tp_kv_split=[3, 0]), r"tp_kv_split\[1\]=0 must be an int >= 1"),
    (dict(tp_kv_split=[2, 2]), r"tp_kv_split=\[2, 2\] sums to 4 but must sum to num_kv_heads=3"),
    (dict(tp_kv_split=[3]), r"tp_kv_split=\[3\] has 1 entries but world_size is 2"),
])
def test_bad_explicit_splits_are_refused_with_the_reason(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_layouts(SMOL, [1, 1], **kwargs)


@pytest.mark.parametrize("budgets, match", [
    ([], "budgets is empty"),
    ([1.0, 0.0], "budget of rank 1 is 0.0"),
    ([-2, 1], "budget of rank 0 is -2"),
    ([1.0, float("nan")], "budget of rank 1 is nan"),
    ([1.0, float("inf")], "budget of rank 1 is inf"),
    ([True, 1], "budget of rank 0 is True"),
])
def test_bad_budgets_are_refused_naming_the_rank(budgets, match):
    with pytest.raises(ValueError, match=match):
        plan_layouts(SMOL, budgets)


# --- the rounding ------------------------------------------------------------------------------------------

def test_proportional_split_largest_remainder_ties_to_the_lower_rank():
    assert proportional_split(8, [1, 1, 1], "x") == (3, 3, 2)
    assert proportional_split(3, [1, 1], "x") == (2, 1)
    assert proportional_split(10, [1, 2, 3, 4], "x") == (1, 2, 3, 4)
    assert proportional_split(7, [5, 3, 2], "x") == (4, 2, 1)  # 3.5, 2.1, 1.4: remainder to the .5
    assert proportional_split(6, [5, 7], "x") == (3, 3)  # 2.5, 3.5: a tie, not round-half-even's (2, 4)


def test_proportional_split_is_exact_on_floats_that_look_equal():
    # Budgets are read as the decimals they print as: 6 * 3.0 / 7.2 == 2.5 and 6 * 4.2 / 7.2 == 3.5 tie and
    # the spare goes to rank 0. Float arithmetic (or the binary value of 4.2) would give rank 1 the spare.
    assert proportional_split(6, [3.0, 4.2], "x") == (3, 3)
    assert proportional_split(4, [30.5, 18.3], "x") == (3, 1)
    assert proportional_split(3, [0.1 + 0.2, 0.1 + 0.2], "x") == (2, 1)
    assert proportional_split(30, [Fraction(1, 3), Fraction(2, 3)], "x") == (10, 20)


def test_proportional_split_keeps_one_per_rank_when_a_quota_is_tiny():
    assert proportional_split(3, [29, 0.5, 0.5], "x") == (1, 1, 1)
    assert proportional_split(10, [97, 1, 1, 1], "x") == (7, 1, 1, 1)
    with pytest.raises(ValueError, match="2 heads cannot be split over 3 ranks"):
        proportional_split(2, [1, 1, 1], "heads")


def test_proportional_split_stays_within_one_of_the_quota():
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 8)
        weights = [rng.uniform(0.5, 40) for _ in range(n)]
        total = rng.randint(n, 200)
        counts = proportional_split(total, weights, "x")
        exact = [Fraction(repr(w)) for w in weights]
        quotas = [total * w / sum(exact) for w in exact]
        assert sum(counts) == total and min(counts) >= 1
        if all(q >= 1 for q in quotas):
            assert all(abs(c - q) < 1 for c, q in zip(counts, quotas)), (total, weights, counts)


def test_random_plans_are_well_formed():
    rng = random.Random(1)
    for _ in range(200):
        kv = rng.randint(1, 8)
        cfg = make_cfg(num_layers=rng.randint(kv, 48), num_heads=kv * rng.randint(1, 4), num_kv_heads=kv,
                       intermediate=rng.randint(kv, 4096), vocab=rng.randint(kv, 5000))
        n = rng.randint(1, kv)
        assert_well_formed(plan_layouts(cfg, [rng.uniform(1, 80) for _ in range(n)]), cfg)


# --- KV block arithmetic -----------------------------------------------------------------------------------

def test_kv_block_bytes_match_in_both_views_when_balanced():
    plan = plan_layouts(SMOL, [1, 1])
    per = 2 * 16 * 64 * 2  # K and V, block of 16 tokens, head_dim 64, fp16
    got = [kv_block_bytes(SMOL, pp, tp, 16, 2) for pp, tp in zip(plan.pp.shards, plan.tp.shards)]
    assert got == [(20 * 3 * per, 30 * 2 * per), (10 * 3 * per, 30 * 1 * per)]
    assert all(a == b for a, b in got)
    with pytest.raises(ValueError, match="block_size=0"):
        kv_block_bytes(SMOL, plan.pp.shards[0], plan.tp.shards[0], 0, 2)


def test_usable_blocks_balanced_leaves_only_the_tail():
    plan = plan_layouts(SMOL, [1, 1])
    b0, b1 = (kv_block_bytes(SMOL, plan.pp.shards[r], plan.tp.shards[r], 16, 2)[0] for r in (0, 1))
    usable, rows = usable_blocks([10 * b0 + 100, 10 * b1], plan, SMOL, 16, 2)
    assert usable == 10
    row = dict(pp_blocks=10, tp_blocks=10, usable=10)
    assert rows == [dict(rank=0, **row, unusable_bytes_pp=100, unusable_bytes_tp=100),
                    dict(rank=1, **row, unusable_bytes_pp=0, unusable_bytes_tp=0)]


def test_usable_blocks_unbalanced_is_the_minimum_over_ranks_and_views():
    cfg = make_cfg(num_layers=5, num_heads=4, num_kv_heads=2)
    plan = plan_layouts(cfg, [1, 1])  # rank 0: PP 3 layers x 2 heads, TP 5 x 1; rank 1: PP 2 x 2, TP 5 x 1
    unit = 2 * 16 * 64 * 2
    usable, rows = usable_blocks([60 * unit, 60 * unit], plan, cfg, 16, 2)
    assert usable == 10  # rank 0's PP view (6 units a block) is the binding one
    assert [(r["pp_blocks"], r["tp_blocks"]) for r in rows] == [(10, 12), (15, 12)]
    assert [(r["unusable_bytes_pp"], r["unusable_bytes_tp"]) for r in rows] == [(0, 10 * unit),
                                                                                 (20 * unit, 10 * unit)]


def test_usable_blocks_refuses_bad_regions():
    plan = plan_layouts(SMOL, [1, 1])
    with pytest.raises(ValueError, match="has 1 entries but the plan has 2 ranks"):
        usable_blocks([1 << 20], plan, SMOL, 16, 2)
    with pytest.raises(ValueError, match="region bytes of rank 1 is -1"):
        usable_blocks([1 << 20, -1], plan, SMOL, 16, 2)


# --- the dataclasses ---------------------------------------------------------------------------------------

def test_layout_spec_and_plan_validate():
    plan = plan_layouts(SMOL, [1, 1])
    with pytest.raises(ValueError, match="unknown layout name 'dp'"):
        LayoutSpec("dp", plan.pp.shards)
    with pytest.raises(ValueError, match="has no shards"):
        LayoutSpec("pp", ())
    with pytest.raises(ValueError, match="not contiguous"):
        LayoutSpec("pp", (plan.pp.shards[1], plan.pp.shards[0]))
    with pytest.raises(ValueError, match=r"ranks \[0\] have tp_size != 2"):
        LayoutSpec("tp", (replace(plan.tp.shards[0], tp_size=1), plan.tp.shards[1]))
    with pytest.raises(ValueError, match="disagrees with the tp shards"):
        replace(plan, kv_heads=(1, 2))
    with pytest.raises(ValueError, match=r"balanced=False but layers=\(20, 10\) vs kv_heads=\(2, 1\) says True"):
        replace(plan, balanced=False)
    with pytest.raises(ValueError, match="wants a 'pp' and a 'tp' layout"):
        LayoutPlan(pp=plan.tp, tp=plan.pp, kv_heads=plan.kv_heads, layers=plan.layers, balanced=True)


def test_planner_imports_no_torch():
    code = "import sys, phaseflip.rank.planner; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
