"""Boot progress: a progress bar over every rank's boot phases on a terminal, log lines elsewhere.

Owns: BootProgress, fed with RankProgress messages (or a rank's in-process callback): a phase's start
names it on the bar while it runs (compiling can take a minute), its end advances the bar. The phases a rank
goes through are known in advance (`rank_phases`): load, pack, arena, kv_alloc, then per layout the GEMM
warm-up, the product forms (CPU), compile and capture.
"""
from __future__ import annotations

import logging
import sys

from tqdm.auto import tqdm

from phaseflip.rank.messages import RankProgress

log = logging.getLogger("phaseflip")


def rank_phases(boot) -> list[str]:
    """The phases each rank of this boot reports, in order (rank/runtime.py's timed phases)."""
    first = ["load", "pack", "arena"] + (["kv_profile"] if boot.num_kv_blocks is None else []) + ["kv_alloc"]
    first += ["compiler_import"] if boot.compile != "off" else []
    per_layout = ["gemm_warm"] + (["forms"] if boot.device == "cpu" else []) + ["compile", "capture"]
    return first + [f"{p}:{name}" for name in boot.layouts for p in per_layout]


class BootProgress:
    def __init__(self, boot, world_size: int):
        self.bar = None
        if sys.stderr.isatty():
            self.bar = tqdm(total=len(rank_phases(boot)) * world_size, desc="boot", unit="phase",
                            leave=False)

    def update(self, msg: RankProgress) -> None:
        """A phase started (msg.ms None: the bar names it while it runs) or ended (the bar advances)."""
        if self.bar is None:
            if msg.ms is not None:
                log.info("boot: rank %d %s %.0f ms", msg.rank, msg.phase, msg.ms)
        elif msg.ms is None:
            self.bar.set_postfix_str(f"rank {msg.rank} {msg.phase}...")
        else:
            self.bar.set_postfix_str(f"rank {msg.rank} {msg.phase} {msg.ms:.0f} ms")
            self.bar.update(1)

    def update_from(self, rank: int):
        """An in-process rank's progress callback."""
        return lambda phase, ms: self.update(RankProgress(rank, phase, ms))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
