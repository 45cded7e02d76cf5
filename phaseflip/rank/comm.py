"""torch.distributed wrappers: the collectives the layouts call explicitly at their call sites.

Owns: RankComm (all_reduce for TP partial sums, send/recv of hidden states between PP stages, gather
of vocab-parallel logits, all_to_all for the KV reshard, a flag agreement for the flip, the smallest
KV block count at boot) and the process-group set-up (gloo on CPU, NCCL on CUDA; gloo's device threads
under SCHED_BATCH where PHASEFLIP_GLOO_BATCH=1). `NoComm` is the group of one rank.
"""
from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist


def init_group(rank: int, world_size: int, device: str, init_method: str | None,
               timeout_s: float = 600.0) -> None:
    """Join the rank group. init_method None = env:// (torchrun sets MASTER_ADDR/PORT, RANK ...).

    The timeout bounds every wait of a collective or a send/recv, including a PP stage waiting for
    the stages before it: it must exceed the longest step. A dead rank is not found by this timeout
    but by the controller, which polls its rank processes (engine/ranks/group.py)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    _gloo_batch_mode()   # a bad value named before the group is joined
    dist.init_process_group(backend, init_method=init_method or "env://", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    batch_gloo_loops()


GLOO_LOOP_THREAD = "gloo_tcp_loop"   # the name gloo's TCP transport gives its device thread
GLOO_BATCH_ENV = "PHASEFLIP_GLOO_BATCH"   # 1: SCHED_BATCH for that thread; 0 (the default): leave it


def batch_gloo_loops(group=None) -> int:
    """With PHASEFLIP_GLOO_BATCH=1, put this process's gloo device threads under SCHED_BATCH (the same
    weight, no wakeup preemption); returns how many (0 when off, where there are none, or where the
    platform has no such policy). A bad value of the variable is named.

    Why it exists: gloo's device thread handles a socket's events only if it can take the pair's lock at
    once; when it cannot, the event stays ready and the thread spins on epoll. Woken by a peer's bytes,
    a normal thread preempts the collective's worker that holds that lock, then spins until the kernel
    ends its time slice (a tick) whenever a core has both. Under SCHED_BATCH a woken device thread waits
    for the running thread instead: the spin goes, but so does its preemption of any other busy thread
    on the core, and then it waits up to a tick itself. Which costs less depends on what else runs
    there (docs/performance.md has both measured), so it is the user's choice, off by default. Called
    after each gloo group is made (the device thread starts with the group and names itself when it
    first runs: a barrier on `group` wakes it where there are peers; with none, it is waited for, 1 s
    at most)."""
    if _gloo_batch_mode() == "0" or not hasattr(os, "SCHED_BATCH"):
        return 0
    dist.barrier(group)
    deadline = time.monotonic() + 1.0
    while not (loops := _threads_named(GLOO_LOOP_THREAD)) and time.monotonic() < deadline:
        time.sleep(0.005)
    count = 0
    for tid in loops:
        try:
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
            count += 1
        except OSError:   # the thread ended meanwhile
            pass
    return count


def _gloo_batch_mode() -> str:
    mode = os.environ.get(GLOO_BATCH_ENV, "0")
    if mode not in ("0", "1"):
        raise ValueError(f"{GLOO_BATCH_ENV}={mode!r}: expected 1 (gloo's device threads under SCHED_BATCH) "
                         "or 0 (left as gloo starts them, the default)")
    return mode


def _threads_named(name: str) -> list[int]:
    tids = []
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == name:
                    tids.append(int(tid))
        except OSError:
            pass
    return tids


class RankComm:
    def __init__(self, rank: int, world_size: int, device: str = "cpu"):
        self.rank = rank
        self.world_size = world_size
        self.device = device  # NCCL reduces device tensors only

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:   # see break_graphs_at_collectives
        dist.all_reduce(x)
        return x

    def send(self, x: torch.Tensor, dst: int) -> None:
        dist.send(x.contiguous(), dst)

    def recv(self, out: torch.Tensor, src: int) -> torch.Tensor:
        dist.recv(out, src)
        return out

    def gather_rows(self, x: torch.Tensor, dst: int, width: int) -> list[torch.Tensor] | None:
        """Gather [N, w_r] pieces (w_r <= width, padded to width on the wire) to dst."""
        padded = torch.zeros(x.shape[0], width, dtype=x.dtype, device=x.device)
        padded[:, :x.shape[1]] = x
        out = [torch.empty_like(padded) for _ in range(self.world_size)] if self.rank == dst else None
        dist.gather(padded, out, dst=dst)
        return out

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                   in_splits: list[int]) -> None:
        dist.all_to_all_single(out, inp, out_splits, in_splits)

    def any(self, flag: bool) -> bool:
        """True on every rank when flag is True on any rank (a flip's agreement after each stage)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def min(self, value: int) -> int:
        """The smallest of every rank's value, on every rank (the KV block count all ranks can hold)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def barrier(self) -> None:
        dist.barrier()


def break_graphs_at_collectives() -> None:
    """Make a compiled layer break its graph at each all-reduce and call it eagerly
    (torch.compiler.disable on RankComm.all_reduce). Called when a rank is about to compile, not at
    import: the decorator imports torch._dynamo, about half of a rank process's import time, which a
    rank that never compiles does not need."""
    global _graph_breaks
    if not _graph_breaks:
        RankComm.all_reduce = torch.compiler.disable(RankComm.all_reduce)
        _graph_breaks = True


_graph_breaks = False   # whether break_graphs_at_collectives has run in this process


class NoComm:
    """A group of one rank: reductions are the identity, there is nobody to send to."""
    rank = 0
    world_size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_rows(self, x, dst, width):
        return [x]

    def all_to_all(self, out, inp, out_splits, in_splits) -> None:
        out.copy_(inp)

    def any(self, flag: bool) -> bool:
        return flag

    def min(self, value: int) -> int:
        return value

    def barrier(self) -> None:
        pass


def env_rank() -> tuple[int, int] | None:
    """(rank, world_size) when launched by torchrun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None
