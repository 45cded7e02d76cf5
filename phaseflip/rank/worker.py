"""The per-rank loop: receive a command -> execute it on the RankRuntime -> reply.

Owns: command dispatch and error capture on a rank. Any exception becomes a RankFailure naming this
rank with its traceback, sent to the controller; the loop ends on Shutdown or when the controller's
end of the channel closes (the controller died).
"""
from __future__ import annotations

import traceback
from typing import Callable, Protocol

from phaseflip.rank.fence import install_rebuild_fence
from phaseflip.rank.messages import (ArmFault, FenceRebuild, FlipCommand, ForgetRequests, LiveStateQuery,
                                        ManifestQuery, PoisonArena, RankFailure, RankLiveState, RankProgress,
                                        RunStep, Shutdown, StatsQuery)
from phaseflip.rank.runtime import RankRuntime


class Channel(Protocol):
    def recv(self): ...
    def send(self, obj) -> None: ...


def handle(rt: RankRuntime, msg):
    """Execute one command; returns its reply."""
    if isinstance(msg, RunStep):
        return rt.run_step(msg)
    if isinstance(msg, FlipCommand):
        return rt.flip(msg)
    if isinstance(msg, ForgetRequests):
        for seq_id in msg.seq_ids:
            rt.sampler.remove(seq_id)
        return RankLiveState(rt.rank, len(rt.sampler))
    if isinstance(msg, LiveStateQuery):
        return RankLiveState(rt.rank, len(rt.sampler))
    if isinstance(msg, ArmFault):
        rt.faults.arm(msg)
        return rt.stats()
    if isinstance(msg, StatsQuery):
        return rt.stats()
    if isinstance(msg, ManifestQuery):
        return rt.manifest()
    if isinstance(msg, FenceRebuild):
        install_rebuild_fence()
        return rt.stats()
    if isinstance(msg, PoisonArena):
        rt.arena.buffer.fill_(0xFF)  # all-ones bytes: NaN in every float dtype
        return rt.stats()
    raise TypeError(f"rank {rt.rank}: unknown command {type(msg).__name__}")


def failure(rank: int, e: BaseException) -> RankFailure:
    return RankFailure(rank, f"{type(e).__name__}: {e}", traceback.format_exc())


def serve(rank: int, make_runtime: Callable[..., RankRuntime], channel: Channel, progress: bool = True) -> None:
    """progress: send a RankProgress as each boot phase starts and ends (the controller draws them)."""
    try:
        rt = make_runtime((lambda phase, ms: channel.send(RankProgress(rank, phase, ms))) if progress else None)
    except Exception as e:  # noqa: BLE001 — reported to the controller with the traceback
        channel.send(failure(rank, e))
        return
    channel.send(rt.ready())
    while True:
        try:
            msg = channel.recv()
        except (EOFError, OSError):
            return  # the controller is gone
        if isinstance(msg, Shutdown):
            channel.send(msg)
            return
        try:
            reply = handle(rt, msg)
        except Exception as e:  # noqa: BLE001
            reply = failure(rank, e)
        channel.send(reply)
