"""Signals that land at the worst moments of a call to the ranks (world size 2, a flip after
every step): the next call either gives the reference tokens or raises EngineDeadError, never a stale
reply; a Ctrl-C right after a reply was read does not lose it; the signal tests pass when the suite is
launched with SIGINT ignored; and a stress run of random Ctrl-Cs under CPU load."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from phaseflip import LLM
from phaseflip.engine.ranks.group import EngineDeadError
from tests import background
from tests.reliability.support import ENGINE, deadline, greedy, python_sigint
from tests.reliability.test_interrupts import NEW, PROMPTS, assert_usable

class Boom(BaseException):
    """What a signal handler other than SIGINT's may raise (a timeout's, a test harness's)."""


def two_ranks(model) -> LLM:
    return LLM(model=model, **ENGINE, world_size=2, flip_every_steps=1)


def usable_or_dead(llm, reference) -> bool:
    """True when the next call works with the reference tokens; False when it says the engine is dead."""
    try:
        assert_usable(llm, reference)
        return True
    except EngineDeadError:
        return False


def hit_at_random(llm, rng, signum: int, expected) -> None:
    """Send `signum` to this process at a random moment of a long run of steps and flips."""
    timer = threading.Timer(rng.uniform(0.0, 0.3), os.kill, (os.getpid(), signum))
    timer.start()
    try:
        with deadline(60, f"a generate hit by {signal.Signals(signum).name}"), pytest.raises(expected):
            for _ in range(1000):
                llm.generate(PROMPTS, greedy(100), use_tqdm=False)
    finally:
        timer.join()


def test_a_ctrl_c_just_after_a_reply_was_read_does_not_lose_it(model, reference):
    """The SIGINT lands once rank 1's reply is off the pipe, before the controller recorded it: an
    interrupted call drains the outstanding replies, and waiting for one already read would hang."""
    with python_sigint(), two_ranks(model) as llm:
        conn = llm.ranks.conns[1]
        recv, fired = conn.recv, []

        def recv_then_interrupt():
            reply = recv()
            if not fired:
                fired.append(1)
                os.kill(os.getpid(), signal.SIGINT)
            return reply
        conn.recv = recv_then_interrupt
        try:
            with deadline(30, "a generate interrupted after a read"), pytest.raises(KeyboardInterrupt):
                llm.generate(PROMPTS, greedy(NEW), use_tqdm=False)
        finally:
            del conn.recv
        assert fired
        assert_usable(llm, reference)


def signal_rounds(model, reference, rounds: int, signum: int, raised, seed: int) -> list[bool]:
    """`rounds` random signals, one per long generate of a 2-rank engine (a new engine after one is
    declared dead); per round, whether the next call found the engine usable."""
    def boom(signum, frame):
        raise Boom
    previous = signal.signal(signal.SIGUSR1, boom)
    rng, outcomes = random.Random(seed), []
    llm = two_ranks(model)
    try:
        with python_sigint():
            for _ in range(rounds):
                hit_at_random(llm, rng, signum, raised)
                outcomes.append(usable_or_dead(llm, reference))
                if not outcomes[-1]:
                    llm.shutdown()
                    llm = two_ranks(model)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        llm.shutdown()
    return outcomes


def test_any_signal_handlers_exception_leaves_no_stale_reply(model, reference):
    """A handler raising Boom at random moments of generate and flip: after each, the next call works
    with the reference tokens or raises EngineDeadError; a stale reply would answer the StatsQuery
    that follows a failed generate with the previous command's StepResult or FlipReport."""
    outcomes = signal_rounds(model, reference, 6, signal.SIGUSR1, Boom, seed=11)
    print(f"Boom rounds: {outcomes.count(True)} usable after, {outcomes.count(False)} declared dead")
    # each round ended usable (the reference tokens) or dead (EngineDeadError); anything else raised in
    # usable_or_dead. A Boom declares the engine dead only when it cuts a send or a read, a small share
    # of a generate's time: six deaths in six rounds would mean any Boom kills it.
    assert len(outcomes) == 6 and True in outcomes, outcomes


@background.register("pytest_with_sigint_ignored")
def _pytest_with_sigint_ignored(session: background.Session) -> background.Job:
    """A child pytest started with SIGINT ignored, running the two tests that send real SIGINTs."""
    chosen = "in_process_flip or command_is_being_sent"
    return background.python("-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", chosen,
                             "tests/reliability/test_interrupts.py", sigint_ignored=True)


@pytest.fixture(scope="session")
def pytest_with_sigint_ignored(_background_jobs):
    return _background_jobs["pytest_with_sigint_ignored"]


def test_the_signal_tests_pass_when_launched_with_sigint_ignored(pytest_with_sigint_ignored):
    """`make test &` from a script starts pytest with SIGINT ignored; the tests that send real SIGINTs
    must install Python's handler themselves (two of them, in a child pytest started that way)."""
    proc = pytest_with_sigint_ignored.result(timeout_s=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("signum,raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGUSR1, Boom)],
                         ids=["ctrl-c", "boom"])
def test_signal_stress_under_load(model, reference, signum, raised):
    """Random signals (PHASEFLIP_STRESS_ROUNDS, default 200) with a CPU-bound process beside the engine.
    A Ctrl-C must leave the engine usable every time; Boom (not held back while a command is sent or a
    reply read) may declare it dead, never leave a stale reply or a hang."""
    rounds = int(os.environ.get("PHASEFLIP_STRESS_ROUNDS", "200"))
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    t0 = time.monotonic()
    try:
        outcomes = signal_rounds(model, reference, rounds, signum, raised, seed=5)
    finally:
        burner.kill()
        burner.wait()
    print(f"{raised.__name__} stress: {rounds} rounds, {outcomes.count(True)} usable after, "
          f"{outcomes.count(False)} declared dead, {time.monotonic() - t0:.0f} s under load")
    assert all(outcomes) or raised is Boom, "a Ctrl-C killed the engine"
