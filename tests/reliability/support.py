"""Shared helpers of the reliability suite: hard time bounds, process and memory probes, and the
"nothing left behind" check every generate must pass.

A hang must fail a test, never wedge the run: `deadline` raises Hang in the main thread when its
time is up (the engine's waits poll, so the alarm gets through), and `wait_gone` polls with a bound.
"""
from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager

from phaseflip import SamplingParams

MAX_MODEL_LEN = 128
ENGINE = dict(dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=8)


class Hang(AssertionError):
    """A call did not finish within its deadline."""


@contextmanager
def deadline(seconds: float, what: str, again_s: float = 5.0):
    """Fail with Hang if the block runs longer than `seconds` (SIGALRM; main thread only). The alarm
    repeats every again_s seconds until the block is left, so cleanup that hangs too is cut short."""
    def expire(signum, frame):
        raise Hang(f"{what} did not finish within {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds, again_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def python_sigint():
    """Python's own SIGINT handler (KeyboardInterrupt) for the block, whatever the launch installed: a
    shell starts a background job with SIGINT ignored (`make test &`, nohup), and then a real signal
    would interrupt nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def alive(pid: int) -> bool:
    """pid runs (a zombie has exited: it only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_gone(pids, timeout_s: float = 10.0) -> list[int]:
    """The pids still alive after up to timeout_s seconds."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def _processes() -> list[tuple[int, int, bytes]]:
    """(pid, ppid, cmdline) of every live process."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if alive(int(entry)):
            found.append((int(entry), ppid, cmdline))
    return found


def rank_processes() -> list[int]:
    """Live rank processes started by this process (found in /proc: also those of a failed boot):
    fresh interpreters it started, and the processes its rank template forked."""
    me, procs = os.getpid(), _processes()
    templates = {pid for pid, ppid, cmd in procs if ppid == me and b"phaseflip.engine.ranks.template" in cmd}
    return [pid for pid, ppid, cmd in procs
            if ppid in templates or (ppid == me and b"phaseflip.engine.ranks.process" in cmd)]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib * 1024


def assert_settled(llm) -> dict:
    """Nothing of any request is left: every KV block is free, no sequence or finished id waits on
    the controller, no rank keeps sampling state. Returns the stats it read."""
    stats = llm.stats()
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"], \
        f"KV blocks leaked: {stats['num_kv_blocks'] - stats['free_kv_blocks']} of {stats['num_kv_blocks']} held"
    left = {k: v for k, v in stats["request_state"].items() if v}
    assert not left, f"request state left on the controller: {left}"
    assert not any(stats["rank_sampler_seqs"]), f"sampling state left on the ranks: {stats['rank_sampler_seqs']}"
    return stats
