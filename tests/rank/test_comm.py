"""The process group's set-up: gloo's device threads under SCHED_BATCH when PHASEFLIP_GLOO_BATCH=1
(rank/comm.py says why, and why it is not the default)."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from phaseflip.rank.comm import GLOO_LOOP_THREAD, RankComm, _threads_named, batch_gloo_loops, init_group

LINUX = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH") or not os.path.isdir("/proc/self/task"),
                           reason="SCHED_BATCH and /proc/self/task are Linux's")


def _policies(tmp_path) -> list[int]:
    init_group(0, 1, "cpu", f"file://{tmp_path / 'store'}", timeout_s=60)
    try:   # the device thread names itself when it first runs: with one rank no message wakes it
        assert torch.equal(RankComm(0, 1).all_reduce(torch.ones(3)), torch.ones(3))
        deadline = time.monotonic() + 10
        while not (loops := _threads_named(GLOO_LOOP_THREAD)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loops, f"no thread named {GLOO_LOOP_THREAD!r}: gloo renamed its device thread?"
        return [os.sched_getscheduler(tid) for tid in loops]
    finally:
        dist.destroy_process_group()


@LINUX
def test_gloo_device_threads_stay_as_gloo_starts_them_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv("PHASEFLIP_GLOO_BATCH", raising=False)
    assert set(_policies(tmp_path)) == {os.SCHED_OTHER}


@LINUX
def test_asked_for_they_run_under_sched_batch_and_the_group_still_reduces(tmp_path, monkeypatch):
    monkeypatch.setenv("PHASEFLIP_GLOO_BATCH", "1")
    assert set(_policies(tmp_path)) == {os.SCHED_BATCH}


def test_no_gloo_thread_is_no_error_and_a_bad_value_is_named(monkeypatch):
    monkeypatch.setenv("PHASEFLIP_GLOO_BATCH", "1")
    assert _threads_named("no-such-thread-name") == []
    monkeypatch.setenv("PHASEFLIP_GLOO_BATCH", "yes")
    with pytest.raises(ValueError, match=r"PHASEFLIP_GLOO_BATCH='yes': expected 1 .* or 0"):
        init_group(0, 1, "cpu", "file:///nonexistent/never-joined")
