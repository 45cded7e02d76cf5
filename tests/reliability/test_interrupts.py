"""Interrupts: a KeyboardInterrupt anywhere in generate (in a step, in a flip, while
a command is being sent to the ranks, at a random moment from a real SIGINT) propagates, and the
engine is usable for the next call: nothing left behind, the controller and the ranks agree on the
active layout, and the next batch gives the single-rank reference tokens. A second interrupt while
the first is being cleaned up declares the engine dead instead of leaving the ranks out of step."""
from __future__ import annotations

import os
import random
import signal
import threading

import pytest

from phaseflip import LLM
from phaseflip.engine.ranks.group import EngineDeadError
from phaseflip.rank.messages import FlipCommand, StatsQuery
from tests.reliability.support import ENGINE, assert_settled, deadline, greedy, ids, python_sigint, wait_gone

PROMPTS = [[5, 6, 7], [40 + i for i in range(30)], [200, 100, 50, 25], [9] * 12]
NEW = 10


@pytest.fixture(autouse=True)
def sigint_raises():
    """These tests send real SIGINTs: they need Python's handler even when launched with it ignored."""
    with python_sigint():
        yield


@pytest.fixture(scope="module")
def flipping(model):
    with LLM(model=model, **ENGINE, world_size=2, flip_every_steps=1) as llm:
        yield llm


def assert_usable(llm, reference) -> None:
    assert_settled(llm)
    actives = {r.active_layout for r in llm.ranks.call(StatsQuery())}
    assert actives == {llm.control.active}, f"controller in {llm.control.active}, ranks in {actives}"
    with deadline(60, "the generate after an interrupt"):
        assert ids(llm.generate(PROMPTS, greedy(NEW), use_tqdm=False)) == reference(PROMPTS, NEW)


def interrupt_collect(llm, at_calls: set[int], log: list) -> None:
    """Raise KeyboardInterrupt in the controller while it waits for the ranks' replies, at the given
    calls of ProcessRanks._collect (as Ctrl-C would); log what was being waited for."""
    collect, send, calls = llm.ranks._collect, llm.ranks.call, []

    def interrupting(replies=None, progress=None, until=None):
        calls.append(1)
        if len(calls) in at_calls:
            raise KeyboardInterrupt
        return collect(replies, progress, until)

    def call(msg):
        log.append(type(msg).__name__)
        return send(msg)
    llm.ranks._collect, llm.ranks.call = interrupting, call


@pytest.mark.parametrize("at_call", range(1, 9))
def test_interrupt_while_waiting_for_the_ranks(flipping, reference, at_call):
    """A flip after every step: the interrupts land in steps and in flips (the ranks flipped, the
    controller never recorded it)."""
    log: list[str] = []
    interrupt_collect(flipping, {at_call}, log)
    try:
        with deadline(60, "an interrupted generate"), pytest.raises(KeyboardInterrupt):
            flipping.generate(PROMPTS, greedy(NEW), use_tqdm=False)
    finally:
        del flipping.ranks._collect, flipping.ranks.call
    assert log[at_call - 1] in ("RunStep", "FlipCommand")
    assert_usable(flipping, reference)


def test_interrupt_while_a_command_is_being_sent(flipping, reference):
    """A real SIGINT arrives between the sends to rank 0 and rank 1: both must still get the command
    (else rank 0 would wait in a collective for a rank that never joins)."""
    conn = flipping.ranks.conns[0]
    send, sent = conn.send, []

    def send_then_interrupt(msg):
        send(msg)
        if isinstance(msg, FlipCommand) and not sent:
            sent.append(msg)
            os.kill(os.getpid(), signal.SIGINT)
    conn.send = send_then_interrupt
    try:
        with deadline(60, "a generate interrupted mid-send"), pytest.raises(KeyboardInterrupt):
            flipping.generate(PROMPTS, greedy(NEW), use_tqdm=False)
    finally:
        del conn.send
    assert sent, "no flip was sent"
    assert_usable(flipping, reference)


def test_real_sigint_at_random_moments(flipping, reference):
    rng = random.Random(7)
    for _ in range(6):
        timer = threading.Timer(rng.uniform(0.0, 0.3), os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        with deadline(60, "a generate hit by SIGINT"), pytest.raises(KeyboardInterrupt):
            for _ in range(1000):  # a long run of steps and flips for the signal to land in
                flipping.generate(PROMPTS, greedy(100), use_tqdm=False)
        timer.join()
        assert_usable(flipping, reference)


def test_second_interrupt_while_cleaning_up_declares_the_engine_dead(model):
    llm = LLM(model=model, **ENGINE, world_size=2, flip_every_steps=1)
    pids = llm.stats()["rank_pids"]
    interrupt_collect(llm, {3, 4}, [])  # the second lands while the first collects its replies
    with deadline(60, "a twice-interrupted generate"), pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, greedy(NEW), use_tqdm=False)
    assert wait_gone(pids, 10.0) == []
    with pytest.raises(EngineDeadError, match=r"engine is dead: interrupted twice .*ranks out of step"):
        llm.generate(PROMPTS, greedy(NEW), use_tqdm=False)
    llm.shutdown()


def test_real_sigint_inside_an_in_process_flip(model, reference, monkeypatch):
    """World size 1 with both layouts: the flip runs in the controller's process, so a Ctrl-C can land
    inside it (here: while it writes the KV into the target view, after the weights were refilled).
    The flip must finish or roll back before the interrupt is raised."""
    import phaseflip.rank.reshard as reshard
    write, fired = reshard.write, []

    def write_then_interrupt(*args, **kwargs):
        if not fired:
            fired.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        return write(*args, **kwargs)
    monkeypatch.setattr(reshard, "write", write_then_interrupt)
    with LLM(model=model, **ENGINE, layouts=("pp", "tp"), flip_every_steps=2) as llm:
        with deadline(60, "an in-process flip hit by SIGINT"), pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, greedy(NEW), use_tqdm=False)
        assert fired
        assert_usable(llm, reference)
