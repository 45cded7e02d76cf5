"""Faults in flips and in boot capture. A flip that fails at read, exchange, refill,
write or cutover, on either rank or on both, rolls back (the engine stays in the source
layout with nothing lost): every request of the batch still completes with the single-rank reference
tokens, the failure is logged with its stage and rank, and the next flips succeed. A fault while a
rank captures at boot fails the boot with an error naming the rank and leaves no process."""
from __future__ import annotations

import dataclasses
import random
import time

import pytest

import phaseflip.engine.llm as llm_module
from phaseflip import LLM
from phaseflip.engine.ranks.group import RankError
from phaseflip.rank.messages import FLIP_STAGES, ArmFault, StatsQuery
from tests.reliability.support import (ENGINE, assert_settled, deadline, greedy, ids, rank_processes,
                                       wait_gone)

NEW = 12


@pytest.fixture(scope="module")
def flipping(model):
    """2 ranks, the weight image parked on the host (every flip refills), a flip every 2 steps."""
    with LLM(model=model, **ENGINE, world_size=2, park="always", flip_every_steps=2) as llm:
        yield llm


@pytest.mark.parametrize("rank", [0, 1, None])
@pytest.mark.parametrize("stage", FLIP_STAGES)
def test_flip_fault_rolls_back_and_every_request_completes(flipping, reference, stage, rank):
    rng = random.Random(f"{stage}{rank}")
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randrange(1, 50))] for _ in range(5)]
    llm, before = flipping, flipping.stats()
    flipping.ranks.call(ArmFault(stage, rank=rank))
    with deadline(60, f"generate with a {stage} fault"):
        outs = llm.generate(prompts, greedy(NEW), use_tqdm=False)
    stats = assert_settled(llm)
    assert ids(outs) == reference(prompts, NEW)
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    # The log keeps only the last flips; the counts are exact.
    num_new = stats["flips"] + stats["failed_flips"] - before["flips"] - before["failed_flips"]
    flips = stats["flip_log"][len(stats["flip_log"]) - num_new:]
    failed = [i for i, e in enumerate(flips) if not e["ok"]]
    assert len(failed) == 1, f"expected one failed flip, got {[(e['direction'], e['ok']) for e in flips]}"
    entry = flips[failed[0]]
    assert entry["failed_stage"] == stage and "injected fault" in entry["error"]
    assert entry["error"].startswith(f"rank {0 if rank is None else rank}: InjectedFault")
    assert any(e["ok"] for e in flips[failed[0] + 1:]), "no flip succeeded after the rolled-back one"
    replies = llm.ranks.call(StatsQuery())
    assert {r.active_layout for r in replies} == {stats["active_layout"]}, "controller and ranks disagree"


def boot_with_fault(monkeypatch, fault: ArmFault) -> None:
    """Make the next LLM's ranks boot with `fault` armed."""
    make = llm_module.rank_boot
    monkeypatch.setattr(llm_module, "rank_boot",
                        lambda cfg, plan: dataclasses.replace(make(cfg, plan), faults=(fault,)))


@pytest.mark.parametrize("world_size, rank", [(1, 0), (2, 0), (2, 1)])
def test_fault_during_boot_capture_fails_the_boot_cleanly(model, reference, monkeypatch, world_size, rank):
    boot_with_fault(monkeypatch, ArmFault("capture", rank=rank))
    before = set(rank_processes())  # other tests' live engines
    t0 = time.monotonic()
    with deadline(60, "a boot with a capture fault"), \
            pytest.raises(RankError, match=rf"^rank {rank} failed: InjectedFault: injected fault at 'capture' "
                                           rf"on rank {rank}") as info:
        LLM(model=model, **ENGINE, world_size=world_size)
    assert "_capture" in info.value.rank_traceback
    left = wait_gone(set(rank_processes()) - before, 10.0)
    print(f"\n[capture fault, world size {world_size}, rank {rank}] boot failed after "
          f"{time.monotonic() - t0:.2f} s; processes left: {left}")
    assert left == []
    if rank != world_size - 1:
        return  # the engine after a failed boot: checked once per world size
    monkeypatch.undo()  # the next engine boots as usual
    with LLM(model=model, **ENGINE, world_size=world_size) as llm:
        assert ids(llm.generate([[5, 6, 7]], greedy(4), use_tqdm=False)) == reference([[5, 6, 7]], 4)


@pytest.fixture(scope="module")
def chunked(model):
    """As `flipping`, with a staging buffer of one block each way: every flip moves its live KV one
    block per chunk, so a flip of a batch has many chunks and a fault can land in the middle one."""
    with LLM(model=model, **ENGINE, world_size=2, park="always", flip_every_steps=2,
             flip_staging_mib=1e-6) as llm:
        yield llm


@pytest.mark.parametrize("stage, rank, chunk", [
    ("read", 0, 1), ("exchange", 1, 1), ("write", 1, 1), ("write", None, 2),   # the chunk in flight
    ("refill", None, None), ("cutover", 0, None),                              # after every chunk moved
])
def test_a_fault_in_the_middle_chunk_rolls_back_every_chunk(chunked, reference, stage, rank, chunk):
    """The chunks already moved go back, the one in flight is restored from the send buffer, and the
    tokens are the fault-free reference's."""
    rng = random.Random(f"chunked{stage}{rank}{chunk}")
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randrange(20, 60))] for _ in range(5)]
    llm, before = chunked, chunked.stats()
    llm.ranks.call(ArmFault(stage, rank=rank, chunk=chunk))
    with deadline(60, f"generate with a {stage} fault at chunk {chunk}"):
        outs = llm.generate(prompts, greedy(NEW), use_tqdm=False)
    stats = assert_settled(llm)
    assert ids(outs) == reference(prompts, NEW)
    flips = stats["flip_log"][len(stats["flip_log"]) - (stats["flips"] + stats["failed_flips"]
                                                       - before["flips"] - before["failed_flips"]):]
    failed = [e for e in flips if not e["ok"]]
    assert len(failed) == 1, f"expected one failed flip, got {[(e['direction'], e['ok']) for e in flips]}"
    entry = failed[0]
    assert (entry["failed_stage"], entry["failed_chunk"]) == (stage, chunk), entry
    assert entry["chunks"] >= 3, f"the failed flip moved {entry['chunks']} chunk(s): no middle one"
    assert all(r["rollback"] > 0 for r in entry["per_rank"]), "a rank did not roll back"
