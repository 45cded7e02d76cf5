"""Which captured layout runs next, and the flips that switch it.

Owns: the active layout as the controller sees it, forced flips (llm.flip), the flip counts (exact) and
the flip log (the last MAX_FLIP_LOG flips: a long-running engine must not grow with every flip). What
to run and when to flip is its rule's (policy/rules.py: the drain rule or the throughput/latency
policy); this class carries the rule's answers out and tells it what every flip measured.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

from phaseflip.engine.policy.rules import Rule, StepSummary, other_layout
from phaseflip.rank.messages import FLIP_STAGES, FlipCommand

log = logging.getLogger("phaseflip")

MAX_FLIP_LOG = 256  # flip log entries kept (~2 KB each); num_flips and num_failed_flips count them all


class LayoutControl:
    def __init__(self, ranks, layouts: tuple[str, ...], rule: Rule, live_blocks: Callable[[], list[int]]):
        """live_blocks: the KV blocks a flip carries over (asked only when flipping)."""
        self.ranks = ranks
        self.rule = rule
        self.live_blocks = live_blocks
        self.layouts = layouts
        self.active = layouts[0]
        self.flip_log: deque[dict] = deque(maxlen=MAX_FLIP_LOG)
        self.num_flips = 0
        self.num_failed_flips = 0

    def allowed(self) -> tuple[bool, bool]:
        """(prefill, decode) the active layout may run now; the rule may flip first."""
        d = self.rule.decide(self.active)
        if d.action == "flip":
            self.flip(d.target)
            d = self.rule.decide(self.active)  # the phases after the cutover (or the fallback)
        return d.prefill, d.decode

    def last_decisions(self, n: int = 3) -> list:
        return list(self.rule.decisions)[-n:]

    def other(self) -> str:
        return other_layout(self.layouts, self.active)

    def after_step(self, summary: StepSummary) -> None:
        """summary: what the step computed (feeds the rule's meters); the rule may flip now."""
        target = self.rule.after_step(self.active, summary)
        if target is not None:
            self.flip(target)

    def on_idle(self) -> None:
        """Nothing could run with the open phases: the rule counts an idle poll or flips to the work."""
        target = self.rule.on_idle(self.active)
        if target is not None:
            self.flip(target)

    def flip(self, target: str) -> dict:
        if target not in self.layouts:
            raise ValueError(f"cannot flip to {target!r}: captured layouts are {', '.join(self.layouts)}")
        if target == self.active:
            return {}
        t0 = time.perf_counter()
        reports = self.ranks.call(FlipCommand(target, tuple(sorted(self.live_blocks()))))
        entry = _log_entry(self.active, target, reports, (time.perf_counter() - t0) * 1e3)
        self.flip_log.append(entry)
        self.rule.observe_flip(entry)
        if entry["ok"]:
            self.active = target
            self.num_flips += 1
            log.info("flip %s: total %.1f ms (%s); kv %d B in %d chunk(s), weights %d B", entry["direction"],
                     entry["total_ms"], ", ".join(f"{c} {entry[c + '_ms']:.1f}" for c in FLIP_STAGES),
                     entry["kv_bytes"], entry["chunks"], entry["weight_bytes"])
        else:
            self.num_failed_flips += 1
            log.warning("flip %s failed at %s (%s); rolled back, staying in %s", entry["direction"],
                        entry["failed_stage"], entry["error"], self.active)
        return entry


def _log_entry(source: str, target: str, reports, total_ms: float) -> dict:
    """One flip: the slowest rank per component (the flip waits for it), bytes summed over ranks."""
    def worst(c):
        values = [r.ms.get(c) for r in reports if r.ms.get(c) is not None]
        return max(values) if values else None
    failed = [r for r in reports if not r.ok]
    first = next((r for r in failed if r.error and "another rank" not in r.error), failed[0] if failed else None)
    return {
        "direction": f"{source}->{target}", "ok": not failed, "total_ms": total_ms,
        **{f"{c}_ms": worst(c) for c in FLIP_STAGES},
        "ranks_total_ms": worst("total"),
        "kv_bytes": sum(r.kv_bytes for r in reports), "weight_bytes": sum(r.weight_bytes for r in reports),
        "chunks": max(r.chunks for r in reports), "staging_bytes": max(r.staging_bytes for r in reports),
        "failed_stage": first.failed_stage if first else None,
        "failed_chunk": first.failed_chunk if first else None,
        "error": f"rank {first.rank}: {first.error}" if first else None,
        "per_rank": [dict(rank=r.rank, ok=r.ok, **r.ms, kv_bytes=r.kv_bytes, weight_bytes=r.weight_bytes)
                     for r in reports],
    }
