"""The KV sized by gpu_memory_utilization: each rank runs profile steps at the
largest buckets before its KV exists, measures what the device then uses, and the pool gets what the
fraction leaves; all ranks agree on the smallest count and the LLM adopts it.

The CPU has no device memory to measure (there the KV stays kv_cache_memory_gib), so these tests run
the CUDA rule on the CPU with the device's readings stood in for: everything else (the profile steps
through the serving path, the arithmetic, the agreement, the adoption, serving on the sized pool) is
the real code. On a GPU the GPU check measures it against the driver."""
from __future__ import annotations

import multiprocessing as mp
import socket

import pytest

from phaseflip import LLM
from phaseflip.engine import boot
from phaseflip.rank import kv_sizing, runtime
from phaseflip.rank.runner import LayoutRunner
from tests.reliability.support import ENGINE, greedy, ids
from tests.reliability.test_capacity import BLOCK, block_bytes

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], list(range(20, 60)), [3] * 17, [40, 41], list(range(100, 130))]


class StoodInDevice:
    """A device of `total` bytes that uses `used` and whose profile steps peak at `peak`; it records
    which steps ran between the start of the peak measurement and its reading."""
    def __init__(self, total: int, used: int, peak: int):
        self.total, self.used, self.peak = total, used, peak
        self.measuring, self.measured, self.events = False, [], []

    def start_peak(self) -> int:
        self.measuring = True
        self.events.append("start")
        return 0

    def peak_since(self, start: int) -> int:
        self.measuring = False
        self.events.append("peak")
        return self.peak

    def free_and_total(self) -> tuple[int, int]:
        self.events.append("free")
        return self.total - self.used, self.total


@pytest.fixture
def device(monkeypatch):
    """Boots size the KV by gpu_memory_utilization=0.5 on the stood-in device (set .used per test)."""
    dev = StoodInDevice(total=0, used=0, peak=0)
    monkeypatch.setattr(boot, "kv_utilization", lambda cfg, device: 0.5)
    monkeypatch.setattr(runtime, "device_memory", lambda device: dev)
    execute = LayoutRunner.execute

    def spy(runner, plan):
        if dev.measuring:
            dev.measured.append((plan.phase.value, plan.num_tokens, plan.num_seqs))
        return execute(runner, plan)
    monkeypatch.setattr(LayoutRunner, "execute", spy)
    return dev


def test_the_kv_gets_what_the_fraction_leaves_after_the_profile_step_and_serves_the_same_tokens(
        model, reference, device):
    per_block = block_bytes(model)
    device.total, device.used, device.peak = 400 * per_block, 150 * per_block + 5, 10 * per_block
    # 0.5 * 400 - 150 - 10 blocks, 5 bytes short of 40: 39 blocks
    with LLM(model=model, **ENGINE) as llm:
        assert llm.stats()["num_kv_blocks"] == 39
        sizing = llm.kv_sizing[0]
        assert sizing["limited_by"] == "this rank's memory" and sizing["tokens"] == 39 * BLOCK
        assert sizing["kv_bytes"] == 39 * per_block and sizing["block_bytes"] == per_block
        assert sizing["profile_peak"] == 10 * per_block and sizing["graph_pool_estimate"] == 0  # no CUDA graphs
        assert "gpu_memory_utilization=0.5" in llm.inspect()["kv"]["sized_by"]
        # The largest prefill bucket (512 tokens as 4 sequences of max_model_len) and the largest
        # decode bucket (8 sequences), measured between the peak's reset and its reading.
        assert device.measured == [("prefill", 512, 4), ("decode", 8, 8)]
        assert device.events == ["start", "peak", "free"]
        assert ids(llm.generate(PROMPTS, greedy(24), use_tqdm=False)) == reference(PROMPTS, 24)
        assert llm.stats()["eager_fallbacks"] == {}   # the profile ran on a registry of its own


def test_a_large_device_gives_every_block_to_the_kv_beyond_what_running_sequences_use(model, device):
    """As vLLM does: blocks beyond max_num_seqs x max_model_len keep cached prefixes."""
    per_block = block_bytes(model)
    device.total, device.used = 4000 * per_block, 100 * per_block
    with LLM(model=model, **ENGINE) as llm:
        assert llm.stats()["num_kv_blocks"] == 1900 > 8 * (128 // BLOCK)
        assert llm.kv_sizing[0]["limited_by"] == "this rank's memory"


def test_a_device_that_cannot_hold_one_sequence_is_refused_naming_the_numbers(model, device):
    per_block = block_bytes(model)
    device.total, device.used = 400 * per_block, 195 * per_block   # 5 blocks left, one sequence needs 8
    with pytest.raises(Exception, match=r"gpu_memory_utilization=0.5 leaves .* \(5 blocks agreed by all ranks"
                                        r".* one sequence of max_model_len=128 tokens needs 8 blocks .*: raise "
                                        r"gpu_memory_utilization, lower max_model_len, or give kv_cache_memory_gib"):
        LLM(model=model, **ENGINE)


def test_gpu_memory_utilization_is_refused_on_the_cpu_and_out_of_range(model):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.8 applies to CUDA devices \(device='cpu'\)"):
        LLM(model=model, **ENGINE, gpu_memory_utilization=0.8)
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match=rf"gpu_memory_utilization={bad} is invalid: must be in \(0, 1\]"):
            LLM(model=model, **ENGINE, gpu_memory_utilization=bad)


def test_fit_blocks_leaves_room_for_the_default_staging():
    mib = 2**20
    # Small pools: the staging is a tenth of the KV (kv + kv / 10 <= room)
    blocks, r = kv_sizing.fit_blocks(1.0, 1101 * mib, 1101 * mib, 0, 0, None, (256 * mib, 0.1), mib)
    assert (blocks, r["staging"]) == (1000, 100 * mib)
    # Large pools: the staging is capped
    blocks, r = kv_sizing.fit_blocks(0.5, 20000 * mib, 20000 * mib, 0, 0, None, (256 * mib, 0.1), mib)
    assert (blocks, r["staging"]) == (10000 - 256, 256 * mib)


def _agree(rank: int, port: int, value: int, out) -> None:
    from phaseflip.rank.comm import RankComm, init_group
    init_group(rank, 2, "cpu", f"tcp://127.0.0.1:{port}", timeout_s=60)
    out.put((rank, RankComm(rank, 2).min(value)))


def test_ranks_agree_on_the_smallest_block_count():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_agree, args=(r, port, v, out)) for r, v in ((0, 900), (1, 345))]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert got == {0: 345, 1: 345}
