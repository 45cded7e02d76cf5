"""Faults in ranks: a step that raises on one rank fails the batch with an error
naming the rank, then the engine refuses new work ("engine is dead") and no rank process is left;
at world size 1 (in-process) the engine recovers honestly instead. SIGKILL of a rank (mid-step, at a
random moment, or while idle) and of the controller: nothing hangs, nothing is left within 10 s."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from phaseflip import LLM
from phaseflip.engine.ranks.group import EngineDeadError, RankError
from phaseflip.rank.messages import ArmFault, RankFailure
from tests.reliability.support import (ENGINE, alive, assert_settled, deadline, greedy, ids, rank_processes,
                                       wait_gone)

PROMPTS = [[5, 6, 7], [40 + i for i in range(30)], [200, 100, 50, 25]]
GONE_S = 10.0   # the bound: no process left this long after a fault or a kill


def after_steps(llm, n: int, action) -> None:
    """Run `action` once, between two steps, when `n` steps of this generate have run."""
    step, count = llm.core.step, []

    def counting():
        count.append(1)
        if len(count) == n:
            action()
        return step()
    llm.core.step = counting


def assert_refuses_new_work(llm, reason: str) -> None:
    for call in (lambda: llm.generate(PROMPTS, greedy(4), use_tqdm=False), lambda: llm.flip("tp"),
                 lambda: llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)):
        with pytest.raises(EngineDeadError, match=rf"engine is dead: {reason}.*create a new LLM"):
            call()


@pytest.mark.parametrize("rank", [0])  # rank 1, at the first step: tests/engine/test_ranks.py
def test_step_fault_names_the_rank_then_the_engine_is_dead(model, rank):
    llm = LLM(model=model, **ENGINE, world_size=2, flip_every_steps=2)
    pids = llm.stats()["rank_pids"]
    after_steps(llm, 4, lambda: llm.ranks.call(ArmFault("step", rank=rank)))  # mid-generate
    with deadline(30, "generate with a failing rank"), \
            pytest.raises(RankError, match=rf"^rank {rank} failed: InjectedFault: injected fault at 'step'"):
        llm.generate(PROMPTS, greedy(16), use_tqdm=False)
    assert wait_gone(pids, GONE_S) == [], "rank processes outlived the failed engine"
    assert_refuses_new_work(llm, f"rank {rank} failed: InjectedFault")
    llm.shutdown()


def test_in_process_step_fault_fails_the_batch_and_the_engine_recovers(model, reference):
    with LLM(model=model, **ENGINE) as llm:
        after_steps(llm, 4, lambda: llm.ranks.call(ArmFault("step")))
        with pytest.raises(RankError, match=r"^rank 0 failed: InjectedFault: injected fault at 'step' on rank 0"):
            llm.generate(PROMPTS, greedy(16), use_tqdm=False)
        assert_settled(llm)
        assert ids(llm.generate(PROMPTS, greedy(16), use_tqdm=False)) == reference(PROMPTS, 16)


@pytest.mark.parametrize("rank", [0])  # rank 1, seconds into a generate: tests/engine/test_ranks.py
def test_rank_killed_at_a_random_moment(model, rank):
    """A flip every step: the kill lands in a step or in a flip. EngineDeadError names the rank and
    its signal; every rank process is gone within 10 s of the kill."""
    llm = LLM(model=model, **ENGINE, world_size=2, flip_every_steps=1)
    pids = llm.stats()["rank_pids"]
    llm.generate(PROMPTS, greedy(4), use_tqdm=False)  # past the first step's warm-up: into steady work
    delay = random.Random(rank).uniform(0.05, 0.4)
    killed = []
    threading.Timer(delay, lambda: (os.kill(pids[rank], signal.SIGKILL), killed.append(time.monotonic()))).start()
    with deadline(30, "generate with a killed rank"), \
            pytest.raises(EngineDeadError, match=rf"engine is dead: rank {rank} \(pid \d+\) died \(signal SIGKILL\)"):
        for _ in range(100):
            llm.generate(PROMPTS, greedy(32), use_tqdm=False)
    noticed_s = time.monotonic() - killed[0]
    left = wait_gone(pids, GONE_S - noticed_s)
    print(f"\n[kill rank {rank} after {delay:.2f} s] EngineDeadError {noticed_s:.2f} s after the kill; "
          f"all gone {time.monotonic() - killed[0]:.2f} s after it")
    assert noticed_s < GONE_S and left == []
    assert_refuses_new_work(llm, f"rank {rank} .*died")
    llm.shutdown()


def test_rank_killed_while_idle(model):
    llm = LLM(model=model, **ENGINE, world_size=2)
    pids = llm.stats()["rank_pids"]
    llm.generate(PROMPTS, greedy(4), use_tqdm=False)
    os.kill(pids[1], signal.SIGKILL)
    wait_gone(pids[1:], 5.0)
    # What a surviving peer reports when a collective with the dead rank breaks: an echo of the
    # death, which must be reported as the death (deterministic; the race is in the test above).
    echo = RankFailure(0, "RuntimeError: Connection closed by peer [127.0.0.1]:1234", "(traceback)")
    with pytest.raises(EngineDeadError, match=r"engine is dead: rank 1 \(pid \d+\) died \(signal SIGKILL\)"):
        llm.ranks._fail(echo)
    t0 = time.monotonic()
    with deadline(30, "generate after a rank died"), \
            pytest.raises(EngineDeadError, match=r"engine is dead: rank 1 \(pid \d+\) died \(signal SIGKILL\)"):
        llm.generate(PROMPTS, greedy(4), use_tqdm=False)
    assert time.monotonic() - t0 < GONE_S
    assert wait_gone(pids, GONE_S) == []
    llm.shutdown()


def test_ranks_exit_when_the_controller_is_killed_mid_generate(model, tmp_path):
    script = tmp_path / "controller.py"
    script.write_text(textwrap.dedent(f"""
        import json
        import torch
        from phaseflip import LLM, SamplingParams
        torch.set_num_threads(1)
        llm = LLM(model={model!r}, dtype="float32", max_model_len=128, world_size=2, flip_every_steps=1)
        print(json.dumps(llm.stats()["rank_pids"]), flush=True)
        while True:
            llm.generate([[5, 6, 7]] * 4, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                         use_tqdm=False)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        with deadline(120, "the controller's boot"):
            pids = json.loads(proc.stdout.readline())
        time.sleep(1.0)  # generating, flipping every step
        assert all(alive(p) for p in pids)
        proc.kill()
        t0 = time.monotonic()
        left = wait_gone(pids, GONE_S)
        print(f"\n[kill controller] ranks gone {time.monotonic() - t0:.2f} s after the kill")
    finally:
        proc.kill()
        proc.wait()
    assert left == [], "rank processes outlived their controller"


def test_an_engine_built_in_a_short_lived_thread_outlives_the_thread(model, reference):
    """The kernel's parent-death signal fires when the THREAD that started a process ends: an LLM built
    in a worker thread must not lose its ranks when that thread returns."""
    box = []
    worker = threading.Thread(target=lambda: box.append(LLM(model=model, **ENGINE, world_size=2)))
    worker.start()
    worker.join()
    with box[0] as llm, deadline(60, "generate on the thread-built engine"):
        time.sleep(1.0)  # the ranks' parent-death watch polls every 0.5 s
        assert all(alive(p) for p in llm.stats()["rank_pids"])
        assert ids(llm.generate(PROMPTS, greedy(8), use_tqdm=False)) == reference(PROMPTS, 8)
    assert rank_processes() == []


def kill_a_new_rank(before: set[int], killed: list) -> None:
    new = sorted(set(rank_processes()) - before)
    if new and not killed:
        os.kill(new[-1], signal.SIGKILL)
        killed.append(time.monotonic())


@pytest.mark.parametrize("when", ["starting", "importing", "booting"])
def test_rank_killed_during_boot(model, monkeypatch, when):
    """'starting': as soon as the rank template has forked the ranks (before they connect back);
    'importing': 0.3 s after the spawn of fresh interpreters (no template), while they import torch;
    'booting': when the first rank reports its first boot phase (loaded, not yet packed or captured)."""
    before, killed = set(rank_processes()), []
    if when in ("starting", "importing"):
        if when == "importing":
            monkeypatch.setenv("PHASEFLIP_RANK_TEMPLATE", "0")

        def kill_soon():
            end = time.monotonic() + 30
            while time.monotonic() < end and len(set(rank_processes()) - before) < 2:
                time.sleep(0.01)
            time.sleep(0.3 if when == "importing" else 0.0)
            kill_a_new_rank(before, killed)
        threading.Thread(target=kill_soon, daemon=True).start()
    else:
        import phaseflip.engine.ranks.group as ranks

        class KillingProgress(ranks.BootProgress):
            def update(self, msg):
                super().update(msg)
                kill_a_new_rank(before, killed)
        monkeypatch.setattr(ranks, "BootProgress", KillingProgress)
    # The kill races the boot: under load a tiny model's rank can finish booting before the signal
    # lands. Then the boot succeeds and the death must be named by the very next call instead.
    with deadline(60, "a boot with a killed rank"), \
            pytest.raises(EngineDeadError, match=r"engine is dead: rank \d \(pid \d+\) died \(signal SIGKILL\)"):
        llm = LLM(model=model, **ENGINE, world_size=2)
        print(f"\n[kill a rank while {when}] the rank had finished booting before the kill landed")
        try:
            llm.generate([PROMPTS[0]], greedy(4), use_tqdm=False)
        finally:
            llm.shutdown()
    assert killed and wait_gone(set(rank_processes()) - before, GONE_S) == []
    print(f"\n[kill a rank while {when}] EngineDeadError {time.monotonic() - killed[0]:.2f} s after the kill")
