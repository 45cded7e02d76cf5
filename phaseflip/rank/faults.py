"""Faults a test arms in a rank (ArmFault): each raises InjectedFault once, at the stage (and flip chunk)
it names, so that a test can make a rank fail where a real one could.

Owns: `Faults`.
"""
from __future__ import annotations

from phaseflip.rank.flip import InjectedFault
from phaseflip.rank.messages import ArmFault


class Faults:
    """Armed test faults of this rank: (stage, chunk or None) -> pending. check() raises once per arming."""
    def __init__(self, rank: int):
        self.rank = rank
        self.armed: set[tuple[str, int | None]] = set()

    def arm(self, cmd: ArmFault) -> None:
        if cmd.rank is None or cmd.rank == self.rank:
            self.armed.add((cmd.stage, cmd.chunk))

    def check(self, stage: str, chunk: int | None = None) -> None:
        for key in ((stage, None), (stage, chunk)):
            if key in self.armed:
                self.armed.discard(key)
                where = "" if chunk is None else f" (chunk {chunk})"
                raise InjectedFault(f"injected fault at {stage!r}{where} on rank {self.rank}")
