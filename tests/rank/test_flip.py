"""The flip on 2 ranks: restore never rebuild (a fence), poisoned restore, injected faults at every
stage with rollback, and each rank holding only its shards."""
import pytest
import torch

from phaseflip import LLM, SamplingParams
from phaseflip.rank.kvcache import KVRegion, KVShape
from phaseflip.rank.messages import ArmFault, FenceRebuild, PoisonArena
from tests.engine.test_parity import parity_prompts
from tests.models import compare_greedy, hf_greedy

NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    d = tiny_model_dir("llama")
    prompts = parity_prompts(384)[:6]
    return d, prompts, hf_greedy(d, prompts, NEW)


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def check(outs, expected):
    ok, _, msg = compare_greedy(ids(outs), expected)
    assert ok, msg


@pytest.mark.parametrize("writer, reader", [("pp", "tp"), ("tp", "pp")])
def test_a_block_is_the_same_bytes_in_both_views(writer, reader):
    """What lets a flip move the live KV a chunk at a time: writing block b in one view changes block
    b in the other and no other block (the two views' blocks differ in size: one is padded)."""
    region = KVRegion({"pp": KVShape(2, 10, 4, 3, 8), "tp": KVShape(4, 10, 4, 1, 8)}, torch.float32)
    for b in range(10):
        region.buffer.zero_()
        region.view(writer).tensor[b].fill_(1.0)
        touched = region.view(reader).tensor.flatten(1).ne(0).any(1).nonzero().flatten().tolist()
        assert touched == [b]


def test_restore_never_rebuild_fence(ref):
    """With every build entry point raising on every rank, 20+ real flips in both directions with live
    requests still give the reference tokens and capture nothing after boot."""
    d, prompts, expected = ref
    with LLM(model=str(d), dtype="float32", world_size=2, park="always", flip_every_steps=1) as llm:
        llm.ranks.call(FenceRebuild())
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.stats()
    check(outs, expected)
    directions = [e["direction"] for e in stats["flip_log"]]
    assert stats["failed_flips"] == 0, stats["flip_log"][-1]
    assert directions.count("pp->tp") >= 10 and directions.count("tp->pp") >= 10
    assert stats["captures_after_boot"] == 0
    assert all(e["weight_bytes"] > 0 for e in stats["flip_log"]), "park='always' must refill on every flip"


def test_poisoned_arena_is_restored_by_the_refill(ref):
    d, prompts, expected = ref
    with LLM(model=str(d), dtype="float32", world_size=2, park="always", policy="drain") as llm:
        check(llm.generate(prompts, GREEDY, use_tqdm=False), expected)   # ends in TP (drain)
        ptrs = llm.stats()["arena_ptrs"]
        for _ in range(3):
            llm.ranks.call(PoisonArena())
            llm.flip("pp")                       # the refill must restore every byte
            llm.ranks.call(PoisonArena())
            llm.flip("tp")
            llm.ranks.call(PoisonArena())
            llm.flip("pp")
            check(llm.generate(prompts, GREEDY, use_tqdm=False), expected)
        assert llm.stats()["arena_ptrs"] == ptrs, "the arena moved"


def test_poison_is_real(ref):
    """Control for the test above: a poisoned arena that nothing refills gives wrong tokens."""
    d, prompts, expected = ref
    with LLM(model=str(d), dtype="float32", layouts=("pp",)) as llm:
        llm.ranks.call(PoisonArena())
        ours = ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert not compare_greedy(ours, expected)[0]


@pytest.mark.parametrize("stage", ["read", "exchange", "refill", "write", "cutover"])
def test_fault_at_each_stage_rolls_back_and_keeps_serving(ref, stage):
    d, prompts, expected = ref
    with LLM(model=str(d), dtype="float32", world_size=2, park="always", policy="drain") as llm:
        llm.ranks.call(ArmFault(stage, rank=1))
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.stats()
        check(outs, expected)
        failed = [e for e in stats["flip_log"] if not e["ok"]]
        assert len(failed) == 1 and failed[0]["failed_stage"] == stage
        assert "rank 1" in failed[0]["error"] and "injected" in failed[0]["error"]
        assert stats["active_layout"] == "pp"       # rolled back, the work ran in PP instead
        # The engine keeps serving, and the next flips work.
        check(llm.generate(prompts, GREEDY, use_tqdm=False), expected)
        other = "tp" if llm.stats()["active_layout"] == "pp" else "pp"
        assert llm.flip(other)["ok"]
        check(llm.generate(prompts, GREEDY, use_tqdm=False), expected)


def test_each_rank_holds_only_its_shards(ref):
    d, _, _ = ref
    with LLM(model=str(d), dtype="float32", world_size=2, park="always") as llm:
        stats = llm.stats()
        model_bytes = sum(t.numel() * t.element_size()
                          for t in __import__("phaseflip.engine.ranks.group", fromlist=["x"])
                          .load_checkpoint(str(d), __import__("torch").float32)[1].values())
    for rank, (arena, shards) in enumerate(zip(stats["arena_bytes"], stats["shard_bytes"])):
        assert arena == max(shards["pp"], shards["tp"]), (rank, arena, shards)
        assert arena < model_bytes
