"""The two rules that decide which captured layout runs next, behind one interface.

Owns: `Rule` (what LayoutControl asks: the phases open now and whether to flip first, a flip wanted
right after a step or when nothing could run, and what each flip measured), `DrainRule` (policy="drain",
and any run with one layout or forced flips) and `PolicyRule` (policy="throughput" | "latency": the
meters fed from real steps and flips, decide.py's decision per step, and the decision log), and
`make_rule`, which picks one from the engine's options. The policy's meters start from an earlier run's
record of the same engine where there is one (record.py) and `keep()` writes what they learned back.

The decision log keeps every change of action/reason/phases with the numbers used; a repeat only bumps
the last record's count; the last MAX_DECISIONS records are kept (a long-running engine must not grow
with every change) and num_decisions counts them all. The drain rule compares no numbers: it logs nothing.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from phaseflip.engine.policy.decide import decide
from phaseflip.engine.policy.terms import Decision, PolicyConfig
from phaseflip.engine.policy.estimators import Meters
from phaseflip.engine.policy.inputs import measure
from phaseflip.engine.policy.record import PolicyRecord

MAX_DECISIONS = 256  # decision records kept, the newest
FALLBACK_STEPS = 32  # steps a failed flip's fallback lasts (drain rule) before it may flip again


@dataclass(frozen=True)
class StepSummary:
    prefill_tokens: int
    decode_tokens: int
    seconds: float
    finished_output_lengths: tuple[int, ...]


def other_layout(layouts: tuple[str, ...], active: str) -> str:
    """The layout that is not `active` (of two)."""
    return next(name for name in layouts if name != active)


class Rule(Protocol):
    decisions: deque            # the decision log, newest last
    num_decisions: int          # records ever logged

    def decide(self, active: str) -> Decision:
        """The phases open in `active` now; action "flip": flip to target first, then ask again."""

    def after_step(self, active: str, summary: StepSummary) -> str | None:
        """What a step computed; returns the layout to flip to right away, if any."""

    def on_idle(self, active: str) -> str | None:
        """Nothing could run with the open phases; returns the layout to flip to, if any."""

    def observe_flip(self, entry: dict) -> None:
        """A flip ran (LayoutControl's log entry: ok, direction, total_ms, ...)."""

    def keep(self) -> None:
        """The engine shuts down: keep what the rule measured for the next boot (if anything)."""


class DrainRule:
    """Prefill in the "pp" layout until nothing admissible waits there, flip, decode in the other until
    the running batch is empty, flip back: the layout changes only when its phase has no work left.
    With one layout, or flips forced every `flip_every_steps` steps, both phases are open everywhere.
    A failed flip opens both phases where the engine stands for FALLBACK_STEPS steps (a hold whose
    bound the step count advances): work never waits on a flip that cannot happen."""

    def __init__(self, layouts: tuple[str, ...], flip_every_steps: int | None = None):
        self.layouts, self.flip_every_steps = layouts, flip_every_steps
        self.decisions: deque[dict] = deque(maxlen=MAX_DECISIONS)   # stays empty: no numbers compared
        self.num_decisions = 0
        self.fallback_until = -1
        self._steps = 0

    def decide(self, active: str) -> Decision:
        if len(self.layouts) == 1 or self.flip_every_steps or self._steps < self.fallback_until:
            return Decision("stay", active, "drain: both phases open", True, True)
        home = "prefill" if active == "pp" else "decode"
        return Decision("stay", active, f"drain: {home} here", active == "pp", active != "pp")

    def after_step(self, active: str, summary: StepSummary) -> str | None:
        self._steps += 1
        forced = self.flip_every_steps and len(self.layouts) > 1 and self._steps % self.flip_every_steps == 0
        return other_layout(self.layouts, active) if forced else None

    def on_idle(self, active: str) -> str | None:
        d = self.decide(active)
        if d.prefill and d.decode:
            raise RuntimeError("no step could be scheduled with both phases open (engine bug)")
        return other_layout(self.layouts, active)  # the work is for the other layout

    def observe_flip(self, entry: dict) -> None:
        self.fallback_until = -1 if entry["ok"] else self._steps + FALLBACK_STEPS

    def keep(self) -> None:
        pass   # it measures nothing


class PolicyRule:
    """policy="throughput" | "latency": each decision measures its inputs (inputs.py) and is decide.py's;
    the meters learn from every step, idle poll and flip, starting from `record`'s seeds if it has any."""

    def __init__(self, config: PolicyConfig, layouts: tuple[str, ...], scheduler, max_model_len: int,
                 record: PolicyRecord | None = None):
        self.config, self.scheduler, self.max_model_len = config, scheduler, max_model_len
        self.record = record
        self.meters = Meters.seeded(layouts, time.perf_counter(), record.seeds if record else {})
        self._measured = False   # a step or flip taught the meters something in this run
        self.decisions: deque[dict] = deque(maxlen=MAX_DECISIONS)
        self.num_decisions = 0  # records ever logged, including those the log has dropped

    def _inputs(self, active: str):
        return measure(self.scheduler, self.meters, active, time.perf_counter(), self.max_model_len)

    def decide(self, active: str) -> Decision:
        inputs = self._inputs(active)
        d = decide(inputs, self.config)
        record = d.record(inputs)
        last = self.decisions[-1] if self.decisions else None
        key = ("layout", "action", "target", "reason", "prefill", "decode")
        if last is not None and all(last[k] == record[k] for k in key):
            last["count"] += 1
            last["last_time_s"] = record["time_s"]
        else:
            self.decisions.append({**record, "count": 1})
            self.num_decisions += 1
        return d

    def after_step(self, active: str, s: StepSummary) -> None:
        if s.seconds > 0 and (s.prefill_tokens == 0 or s.decode_tokens == 0):
            self.meters.rates[active].observe_step(s.prefill_tokens, s.decode_tokens, s.seconds)
            self._measured = True
        for n in s.finished_output_lengths:
            self.meters.outputs.observe(n)
        self._poll(active, s.prefill_tokens, s.decode_tokens)

    def on_idle(self, active: str) -> None:
        self._poll(active, 0, 0)

    def _poll(self, active: str, prefill_tokens: int, decode_tokens: int) -> None:
        after = self._inputs(active)
        self.meters.tracker.on_poll(time.perf_counter(), prefill_tokens, decode_tokens, after.num_carried_decodes,
                             after.admissible_prefill_tokens)

    def observe_flip(self, entry: dict) -> None:
        if entry["ok"]:
            self.meters.legs[entry["direction"]].observe(entry["total_ms"] / 1e3)
            self.meters.tracker.on_cutover(time.perf_counter())
            self._measured = True
        else:
            self.meters.tracker.on_flip_failed()

    def keep(self) -> None:
        if self.record is not None and self._measured:
            self.record.save(self.meters.seeds())


def has_choice(policy: str, layouts: tuple[str, ...], flip_every_steps: int | None) -> bool:
    """Whether the policy chooses the layout (and so prices it): two layouts, no forced flips, not the
    drain rule. Only then is there a record of its measurements to read or keep."""
    return policy != "drain" and len(layouts) >= 2 and not flip_every_steps


def make_rule(policy: str, ttft_budget_s: float | None, layouts: tuple[str, ...], flip_every_steps: int | None,
              scheduler, max_model_len: int, record: PolicyRecord | None = None) -> Rule:
    """The policy where it has a choice to make (has_choice), else the drain rule."""
    if not has_choice(policy, layouts, flip_every_steps):
        return DrainRule(layouts, flip_every_steps)
    return PolicyRule(PolicyConfig(mode=policy, ttft_budget_s=ttft_budget_s), layouts, scheduler, max_model_len,
                      record)
