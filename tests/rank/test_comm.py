"""The process group's set-up: gloo's device threads run under SCHED_BATCH (rank/comm.py says why)."""
import os

import pytest
import torch
import torch.distributed as dist

from phaseflip.rank.comm import GLOO_LOOP_THREAD, RankComm, _threads_named, batch_gloo_loops, init_group


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH") or not os.path.isdir("/proc/self/task"),
                    reason="SCHED_BATCH and /proc/self/task are Linux's")
def test_the_gloo_device_thread_runs_under_sched_batch_and_the_group_still_reduces(tmp_path):
    init_group(0, 1, "cpu", f"file://{tmp_path / 'store'}", timeout_s=60)
    try:
        loops = _threads_named(GLOO_LOOP_THREAD)
        assert loops, f"no thread named {GLOO_LOOP_THREAD!r}: gloo renamed its device thread?"
        assert all(os.sched_getscheduler(tid) == os.SCHED_BATCH for tid in loops)
        assert batch_gloo_loops() == len(loops)   # again: no error, the same threads
        x = torch.ones(3)
        assert torch.equal(RankComm(0, 1).all_reduce(x), torch.ones(3))
    finally:
        dist.destroy_process_group()


def test_no_gloo_thread_is_no_error():
    assert _threads_named("no-such-thread-name") == []


def test_the_variable_turns_it_off_and_a_bad_value_is_named(monkeypatch):
    monkeypatch.setenv("PHASEFLIP_GLOO_BATCH", "0")
    assert batch_gloo_loops() == 0
    monkeypatch.setenv("PHASEFLIP_GLOO_BATCH", "yes")
    with pytest.raises(ValueError, match=r"PHASEFLIP_GLOO_BATCH='yes': expected 1 .* or 0"):
        init_group(0, 1, "cpu", "file:///nonexistent/never-joined")
