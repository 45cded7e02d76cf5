"""Which captured layout runs next, and the flips that switch it.

Owns: the active layout as the controller sees it, the phases it may run, forced flips
(flip_every_steps, llm.flip), the flip counts (exact) and the flip log (the last MAX_FLIP_LOG flips:
a long-running engine must not grow with every flip). Two rules decide: the policy (engine/policy.py
through engine/policy_rule.py; policy="throughput" | "latency") or the plain drain rule (policy="drain":
prefill in PP until no admissible prompt waits, flip, decode in TP until the running batch is empty,
flip back). A failed flip leaves the engine in the old layout and opens both phases there, so work
never waits on a flip that cannot happen (LESSONS 10).
"""
from __future__ import annotations

import logging
import time
from collections import deque

from phaseflip.layouts.messages import FlipCommand

log = logging.getLogger("phaseflip")

COMPONENTS = ("read", "exchange", "refill", "write", "cutover")
FALLBACK_STEPS = 32  # steps a failed flip's fallback lasts before the rule may flip again
MAX_FLIP_LOG = 256  # flip log entries kept (~2 KB each); num_flips and num_failed_flips count them all


class LayoutControl:
    def __init__(self, ranks, layouts: tuple[str, ...], flip_every_steps: int | None, rule=None):
        self.ranks = ranks
        self.rule = rule if len(layouts) > 1 and not flip_every_steps else None  # None: the drain rule
        self.layouts = layouts
        self.flip_every_steps = flip_every_steps
        self.active = layouts[0]
        self.flip_log: deque[dict] = deque(maxlen=MAX_FLIP_LOG)
        self.num_flips = 0
        self.num_failed_flips = 0
        self.fallback_until = -1  # after a failed flip, both phases run here until this step count
        self._steps = 0

    @property
    def fallback(self) -> bool:
        """A failed flip opens both phases in the current layout for FALLBACK_STEPS steps (a hold with
        a bound the step count advances), then the rule tries to flip again."""
        return self._steps < self.fallback_until

    def allowed(self, live_blocks=None) -> tuple[bool, bool]:
        """(prefill, decode) the active layout may run now; the policy may flip first."""
        if self.rule is not None:
            d = self.rule.decide(self.active)
            if d.action == "flip" and live_blocks is not None:
                self.flip(d.target, live_blocks())
                d = self.rule.decide(self.active)  # the phases after the cutover (or the fallback)
            return d.prefill, d.decode
        if len(self.layouts) == 1 or self.flip_every_steps or self.fallback:
            return True, True
        return (True, False) if self.active == "pp" else (False, True)

    def last_decisions(self, n: int = 3) -> list:
        return list(self.rule.decisions)[-n:] if self.rule is not None else ["the drain rule"]

    def other(self) -> str:
        return next(name for name in self.layouts if name != self.active)

    def after_step(self, live_blocks, summary=None) -> None:
        """live_blocks: a callable giving the KV blocks of live sequences (computed only to flip);
        summary: what the step computed (feeds the policy's meters)."""
        self._steps += 1
        if self.rule is not None and summary is not None:
            self.rule.observe_step(self.active, summary)
        if self.flip_every_steps and len(self.layouts) > 1 and self._steps % self.flip_every_steps == 0:
            self.flip(self.other(), live_blocks())

    def on_idle(self, live_blocks) -> None:
        """Nothing could run with the open phases. The policy counts an idle poll (its stall exit and
        hold bounds advance on them); the drain rule switches to where the work is."""
        if self.rule is not None:
            self.rule.observe_idle(self.active)
            return
        if self.allowed() == (True, True):
            raise RuntimeError("no step could be scheduled with both phases open (engine bug)")
        self.flip(self.other(), live_blocks())

    def flip(self, target: str, live_blocks) -> dict:
        if target not in self.layouts:
            raise ValueError(f"cannot flip to {target!r}: captured layouts are {', '.join(self.layouts)}")
        if target == self.active:
            return {}
        t0 = time.perf_counter()
        reports = self.ranks.call(FlipCommand(target, tuple(sorted(live_blocks))))
        entry = _log_entry(self.active, target, reports, (time.perf_counter() - t0) * 1e3)
        self.flip_log.append(entry)
        if self.rule is not None:
            self.rule.observe_flip(entry)
        if entry["ok"]:
            self.active, self.fallback_until = target, -1
            self.num_flips += 1
            log.info("flip %s: total %.1f ms (%s); kv %d B in %d chunk(s), weights %d B", entry["direction"],
                     entry["total_ms"], ", ".join(f"{c} {entry[c + '_ms']:.1f}" for c in COMPONENTS),
                     entry["kv_bytes"], entry["chunks"], entry["weight_bytes"])
        else:
            self.fallback_until = self._steps + FALLBACK_STEPS
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
        **{f"{c}_ms": worst(c) for c in COMPONENTS},
        "ranks_total_ms": worst("total"),
        "kv_bytes": sum(r.kv_bytes for r in reports), "weight_bytes": sum(r.weight_bytes for r in reports),
        "chunks": max(r.chunks for r in reports), "staging_bytes": max(r.staging_bytes for r in reports),
        "failed_stage": first.failed_stage if first else None,
        "failed_chunk": first.failed_chunk if first else None,
        "error": f"rank {first.rank}: {first.error}" if first else None,
        "per_rank": [dict(rank=r.rank, ok=r.ok, **r.ms, kv_bytes=r.kv_bytes, weight_bytes=r.weight_bytes)
                     for r in reports],
    }
