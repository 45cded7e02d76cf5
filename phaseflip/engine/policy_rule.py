"""The layout policy wired to the live engine: meters fed from real steps and flips, a decision per
step, and the decision log.

Owns: PolicyRule — the ProgressTracker, one RateEstimator per layout, one FlipCostEstimator per
direction (unseeded: unpriced until measured, and then the policy follows the drain rule), the
OutputLengthEstimator, and `decisions` (every change of action/reason/phases with the numbers used;
a repeat only bumps the last record's count; the last MAX_DECISIONS records are kept, so a long-running
engine does not grow with every change, and num_decisions counts them all). The decisions themselves are
engine/policy.py's.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from phaseflip.engine.estimators import (FlipCostEstimator, OutputLengthEstimator, ProgressTracker,
                                         RateEstimator, direction)
from phaseflip.engine.policy import Decision, PolicyConfig, decide
from phaseflip.engine.policy_inputs import measure

MAX_DECISIONS = 256  # decision records kept, the newest


@dataclass(frozen=True)
class StepSummary:
    prefill_tokens: int
    decode_tokens: int
    seconds: float
    finished_output_lengths: tuple[int, ...]


class PolicyRule:
    def __init__(self, config: PolicyConfig, layouts: tuple[str, ...], scheduler, max_model_len: int):
        self.config, self.scheduler, self.max_model_len = config, scheduler, max_model_len
        self.tracker = ProgressTracker(time.perf_counter())
        self.rates = {name: RateEstimator(name) for name in layouts}
        self.legs = {direction(a, b): FlipCostEstimator(direction(a, b)) for a in layouts for b in layouts if a != b}
        self.outputs = OutputLengthEstimator()
        self.decisions: deque[dict] = deque(maxlen=MAX_DECISIONS)
        self.num_decisions = 0  # records ever logged, including those the log has dropped

    def _inputs(self, active: str):
        return measure(self.scheduler, active, time.perf_counter(), self.max_model_len, self.tracker,
                       self.rates, self.legs, self.outputs)

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

    def observe_step(self, active: str, s: StepSummary) -> None:
        if s.seconds > 0 and (s.prefill_tokens == 0 or s.decode_tokens == 0):
            self.rates[active].observe_step(s.prefill_tokens, s.decode_tokens, s.seconds)
        for n in s.finished_output_lengths:
            self.outputs.observe(n)
        self._poll(active, s.prefill_tokens, s.decode_tokens)

    def observe_idle(self, active: str) -> None:
        self._poll(active, 0, 0)

    def _poll(self, active: str, prefill_tokens: int, decode_tokens: int) -> None:
        after = self._inputs(active)
        self.tracker.on_poll(time.perf_counter(), prefill_tokens, decode_tokens, after.num_carried_decodes,
                             after.admissible_prefill_tokens)

    def observe_flip(self, entry: dict) -> None:
        if entry["ok"]:
            self.legs[entry["direction"]].observe(entry["total_ms"] / 1e3)
            self.tracker.on_cutover(time.perf_counter())
        else:
            self.tracker.on_flip_failed()
