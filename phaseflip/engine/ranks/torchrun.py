"""The rank group under torchrun: rank 0 is the controller, the other ranks serve it.

Owns: TorchrunRanks (rank 0: the controller and rank 0's runtime in one process; commands broadcast
to the other ranks over a gloo group, replies gathered back) and serve_torchrun_rank (ranks > 0:
receive the boot and the commands from rank 0 until Shutdown). torchrun started these processes
(env:// rendezvous, possibly on other nodes) and manages their lives: this module never spawns,
watches or kills a process. A rank's exception reaches the caller as RankError, as in engine/ranks/group.py.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from phaseflip.engine.ranks.process import comm_device, load_checkpoint, set_threads
from phaseflip.engine.ranks.group import EngineDeadError, RankError
from phaseflip.rank.comm import RankComm, batch_gloo_loops, init_group
from phaseflip.rank.messages import RankBoot, RankFailure, Shutdown
from phaseflip.rank.runtime import RankRuntime
from phaseflip.rank.worker import failure, handle, serve


class _DistChannel:
    """A rank's channel under torchrun: commands broadcast from rank 0, replies gathered to it."""
    def __init__(self, group):
        self.group = group

    def recv(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def send(self, reply) -> None:
        dist.gather_object(reply, None, dst=0, group=self.group)


def _torchrun_group(world_size: int, device: str):
    rank = int(os.environ["RANK"])
    init_group(rank, world_size, device, None)
    # Control messages travel over gloo, and a worker may wait for the next command indefinitely.
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
    batch_gloo_loops(group)   # the new group's device thread
    return rank, group


def serve_torchrun_rank(device: str = "auto") -> None:
    """Ranks > 0 under torchrun: receive the boot and the commands from rank 0 (the controller)."""
    world_size = int(os.environ["WORLD_SIZE"])
    if device == "auto":  # the same rule as the controller's device="auto"
        device = "cuda" if torch.cuda.is_available() else "cpu"
    rank, group = _torchrun_group(world_size, device)
    channel = _DistChannel(group)
    boot: RankBoot = channel.recv()
    set_threads(boot, world_size)
    comm = RankComm(rank, world_size, comm_device(boot, rank))
    serve(rank, lambda progress: RankRuntime(boot, rank, comm, load_checkpoint), channel, progress=False)
    dist.destroy_process_group()


class TorchrunRanks:
    """Rank 0 under torchrun: the controller and rank 0's runtime share this process; the other
    ranks were started by torchrun (env:// rendezvous, possibly on other nodes)."""

    def __init__(self, boot: RankBoot, world_size: int):
        self.world_size = world_size
        self.dead: str | None = None
        rank, self.group = _torchrun_group(world_size, boot.device)
        if rank != 0:
            raise RuntimeError(f"LLM() runs on torchrun rank 0 only; rank {rank} serves (serve_torchrun_rank)")
        set_threads(boot, world_size)
        self._broadcast(boot)
        try:
            runtime = RankRuntime(boot, 0, RankComm(0, world_size, comm_device(boot, 0)), load_checkpoint)
            mine = runtime.ready()
        except Exception as e:  # noqa: BLE001
            runtime, mine = None, failure(0, e)
        self.runtime = runtime
        self.ready = self._gather(mine)
        self.pids = [None] * world_size  # other nodes' processes are torchrun's to manage

    def _broadcast(self, msg) -> None:
        dist.broadcast_object_list([msg], src=0, group=self.group)

    def _gather(self, mine) -> list:
        replies = [None] * self.world_size
        dist.gather_object(mine, replies, dst=0, group=self.group)
        for reply in replies:
            if isinstance(reply, RankFailure):
                self.dead = f"rank {reply.rank} failed: {reply.error}"
                raise RankError(reply.rank, reply.error, reply.traceback)
        return replies

    def call(self, msg) -> list:
        if self.dead:
            raise EngineDeadError(f"engine is dead: {self.dead}")
        try:
            self._broadcast(msg)
            try:
                mine = handle(self.runtime, msg)
            except Exception as e:  # noqa: BLE001
                mine = failure(0, e)
            return self._gather(mine)
        except BaseException as e:  # a Ctrl-C or a signal handler's exception: the peers are left
            if self.dead is None:   # mid-collective, and no reply can be drained from a collective
                self.dead = f"{type(e).__name__} interrupted a call to the ranks: ranks out of step"
            raise

    def shutdown(self) -> None:
        if self.dead is None:
            self.dead = "shut down"
            self._broadcast(Shutdown())
            self._gather(Shutdown())
            dist.destroy_process_group()
