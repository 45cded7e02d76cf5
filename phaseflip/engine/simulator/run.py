"""A modelled rig driven by the SAME policy code the engine runs: layout rates and per-leg flip costs from
a rig profile (JSON), requests from an arrival trace (JSONL); reports throughput, time-to-first-token
percentiles and flips for the policy and for the static layouts.

Owns: the discrete step model and its result (SimResult); rig profiles are loaded and validated in
rig.py (every number labelled measured / derived / assumption), arrival traces in trace.py. The step
model, and what it assumes:
  - a step runs the decodes of every decode-ready sequence (if decode is open) and up to `chunk_tokens`
    prompt tokens (if prefill is open; running prefills first, then FIFO admission);
  - a prefill step takes tokens / prefill_tok_s, a decode step the rig's step time at its batch, a mixed
    step both, less the share `mixed_step_shared` of a batch-of-one decode step (weight reads it shares);
  - admission reserves KV for prompt + max_tokens (no preemption); a sequence's first token comes with
    the step that finishes its prompt;
  - a flip takes the next of its direction's sampled totals; a failed one wastes `failed_flip_fraction`
    of it and changes nothing; an idle poll (nothing could run) costs `idle_poll_s`.
The policy sees only what LayoutControl would measure: rates and flip costs through the estimators of
policy/estimators.py (seeded as boot calibration would), counters through its ProgressTracker.

Must never: import torch, or re-implement a policy rule (it calls policy/decide.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

from phaseflip.engine.policy.decide import decide
from phaseflip.engine.policy.terms import Decision, PolicyConfig, PolicyInputs
from phaseflip.engine.policy.estimators import (FlipCostEstimator, OutputLengthEstimator, ProgressTracker,
                                                RateEstimator, direction)
from phaseflip.engine.simulator.rig import Rig
from phaseflip.engine.simulator.trace import TraceRequest

DecideFn = Callable[[PolicyInputs, PolicyConfig], Decision]


# -- the run -----------------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Seq:
    req: TraceRequest
    reserved: int                   # KV blocks reserved at admission
    prefill_left: int = field(init=False)   # prompt tokens not in KV yet (an attribute: read millions of times)
    generated: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None

    def __post_init__(self):
        self.prefill_left = self.req.prompt_tokens

    @property
    def computed(self) -> int:      # prompt tokens in KV
        return self.req.prompt_tokens - self.prefill_left

    @property
    def is_decode(self) -> bool:
        return self.prefill_left == 0 and self.generated < self.req.output_tokens


@dataclass(frozen=True)
class SimResult:
    label: str
    completed: bool
    makespan_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    ttft_s: tuple[float, ...]
    flips: int
    failed_flips: int
    flip_time_s: float
    idle_polls_with_work: int       # polls where nothing ran although requests were pending
    reasons: Mapping[str, int]      # decisions taken, by reason
    events: tuple[dict, ...]        # every flip attempt, with the decision's numbers and the queue state

    @property
    def tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.makespan_s if self.makespan_s > 0 else 0.0

    def ttft_pct(self, q: float) -> float | None:
        if not self.ttft_s:
            return None
        ordered = sorted(self.ttft_s)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def static_decide(inputs: PolicyInputs, config: PolicyConfig) -> Decision:
    """The static baseline: never flip, run both phases in the layout it started in."""
    return Decision("stay", inputs.active, "static", True, True)


class _Run:
    """One simulation: the queue state, the modelled clock and the caller-side meters."""

    def __init__(self, rig: Rig, trace, start: str, flip_faults):
        self.rig, self.active, self.now = rig, start, 0.0
        self.future = list(reversed(trace))       # pop() = next arrival
        self.waiting: list[_Seq] = []
        self.running: list[_Seq] = []
        self.done: list[_Seq] = []
        self.reserved = 0
        self.tracker = ProgressTracker(0.0)
        self.rates = {k: RateEstimator(k, r.prefill_tok_s, dict(r.decode_step_s)) for k, r in rig.layouts.items()}
        self.legs = {leg: FlipCostEstimator(leg, rig.flip_prior_s[leg]) for leg in rig.flip_samples_s}
        self.outputs = OutputLengthEstimator()
        self.flip_faults, self.attempts, self.leg_uses = set(flip_faults), 0, {leg: 0 for leg in self.legs}
        self.flips = self.failed = self.idle_polls = 0
        self.flip_time = 0.0
        self.reasons: dict[str, int] = {}
        self.events: list[dict] = []

    # -- what LayoutControl would measure --------------------------------------------------------------------
    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.rig.block_size)

    def _fits(self, seq_reserve: int, reserved: int, slots: int) -> bool:
        return slots < self.rig.max_num_seqs and reserved + seq_reserve <= self.rig.num_kv_blocks

    def admissible_tokens(self, as_if_empty: bool = False) -> int:
        """Prefill that could run now (or, as_if_empty, with every running sequence's KV and slot free)."""
        tokens = 0 if as_if_empty else sum(s.prefill_left for s in self.running)
        reserved, slots = (0, 0) if as_if_empty else (self.reserved, len(self.running))
        for seq in self.waiting:
            if not self._fits(seq.reserved, reserved, slots):
                break
            tokens, reserved, slots = tokens + seq.req.prompt_tokens, reserved + seq.reserved, slots + 1
        return tokens

    def inputs(self) -> PolicyInputs:
        carried = [s for s in self.running if s.is_decode]
        used = sum(self.blocks(s.computed + s.generated) for s in self.running)
        unstarted = [s.req.arrival_s for s in self.waiting + self.running if s.first_token_s is None]
        admissible = self.admissible_tokens()
        return PolicyInputs(
            active=self.active, now_s=self.now,
            pending_prefill_tokens=sum(s.prefill_left for s in self.waiting + self.running),
            admissible_prefill_tokens=admissible,
            fillable_prefill_tokens=max(admissible, self.admissible_tokens(as_if_empty=True)),
            num_waiting=len(self.waiting),
            num_running=len(self.running), num_carried_decodes=len(carried),
            carried_decode_tokens=sum(self.outputs.expected_left(s.generated, s.req.max_tokens) for s in carried),
            free_kv_blocks=self.rig.num_kv_blocks - used, bundle_kv_blocks=self.reserved - used,
            oldest_wait_s=self.now - min(unstarted) if unstarted else None,
            progress=self.tracker.snapshot(), rates={k: e.reading() for k, e in self.rates.items()},
            legs={k: e.reading() for k, e in self.legs.items()})

    # -- the modelled engine --------------------------------------------------------------------------------
    def arrive(self) -> None:
        while self.future and self.future[-1].arrival_s <= self.now:
            req = self.future.pop()
            self.waiting.append(_Seq(req, self.blocks(req.prompt_tokens + req.max_tokens)))

    def step(self, prefill: bool, decode: bool) -> bool:
        """Run one step with the open phases; False when nothing could run (an idle poll)."""
        batch = [s for s in self.running if s.is_decode] if decode else []
        chunks = self._prefill_chunks() if prefill else []
        num_prefill = sum(n for _, n in chunks)
        if not batch and not chunks:
            self.now += self.rig.idle_poll_s
            self.idle_polls += 1
            self.tracker.on_poll(self.now, 0, 0, sum(s.is_decode for s in self.running),
                                 self.admissible_tokens())
            return False
        seconds = self._step_seconds(num_prefill, len(batch))
        self.now += seconds
        self.rates[self.active].observe_step(num_prefill, len(batch), seconds)
        for seq in batch:
            seq.generated += 1
        for seq, n in chunks:
            seq.prefill_left -= n
            if seq.prefill_left == 0:
                seq.generated, seq.first_token_s = 1, self.now
        self._finish()
        self.tracker.on_poll(self.now, num_prefill, len(batch), sum(s.is_decode for s in self.running),
                             self.admissible_tokens())
        return True

    def _prefill_chunks(self) -> list[tuple[_Seq, int]]:
        budget, chunks = self.rig.chunk_tokens, []
        for seq in [s for s in self.running if s.prefill_left > 0]:
            if budget == 0:
                return chunks
            chunks.append((seq, min(seq.prefill_left, budget)))
            budget -= chunks[-1][1]
        while budget and self.waiting and self._fits(self.waiting[0].reserved, self.reserved, len(self.running)):
            seq = self.waiting.pop(0)
            self.running.append(seq)
            self.reserved += seq.reserved
            chunks.append((seq, min(seq.prefill_left, budget)))
            budget -= chunks[-1][1]
        return chunks

    def _step_seconds(self, num_prefill: int, batch: int) -> float:
        rates = self.rig.layouts[self.active]
        if not num_prefill:
            return rates.step_s(batch)
        shared = self.rig.mixed_step_shared[self.active] * rates.step_s(1)
        return rates.prefill_s(num_prefill) + (rates.step_s(batch) - shared if batch else 0.0)

    def _finish(self) -> None:
        for seq in [s for s in self.running if s.prefill_left == 0 and s.generated >= s.req.output_tokens]:
            self.running.remove(seq)
            self.reserved -= seq.reserved
            seq.finish_s = self.now
            self.done.append(seq)
            self.outputs.observe(seq.generated)

    def flip(self, decision: Decision, inputs: PolicyInputs) -> None:
        leg = direction(self.active, decision.target)
        seconds = self.rig.flip_s(leg, self.leg_uses[leg])
        self.leg_uses[leg] += 1
        ok = self.attempts not in self.flip_faults
        self.attempts += 1
        wasted = seconds if ok else seconds * self.rig.failed_flip_fraction
        self.now += wasted
        self.flip_time += wasted
        self.events.append({"time_s": self.now, "direction": leg, "ok": ok, "seconds": wasted,
                            "reason": decision.reason, "numbers": dict(decision.numbers),
                            "num_running": inputs.num_running, "num_waiting": inputs.num_waiting,
                            "num_carried_decodes": inputs.num_carried_decodes,
                            "pending_prefill_tokens": inputs.pending_prefill_tokens})
        if ok:
            self.active, self.flips = decision.target, self.flips + 1
            self.legs[leg].observe(seconds)
            self.tracker.on_cutover(self.now)
        else:
            self.failed += 1
            self.tracker.on_flip_failed()


def simulate(rig: Rig, trace, config: PolicyConfig, *, decide_fn: DecideFn = decide, start: str = "pp",
             offline: bool = False, flip_faults=(), label: str = "policy", max_polls: int = 2_000_000) -> SimResult:
    """Run `trace` on `rig` under `decide_fn`. offline=True submits every request at t=0 (a batch)."""
    if offline:
        trace = [TraceRequest(0.0, r.prompt_tokens, r.output_tokens, r.max_tokens) for r in trace]
    _check_fits(rig, trace)
    run = _Run(rig, list(trace), start, flip_faults)
    for _ in range(max_polls):
        run.arrive()
        if not run.waiting and not run.running:
            if not run.future:
                break
            run.now = run.future[-1].arrival_s
            continue
        inputs = run.inputs()
        decision = decide_fn(inputs, config)
        run.reasons[decision.reason] = run.reasons.get(decision.reason, 0) + 1
        if decision.action == "flip":
            run.flip(decision, inputs)
        else:
            run.step(decision.prefill, decision.decode)
    return _result(run, trace, label)


def _check_fits(rig: Rig, trace) -> None:
    for i, r in enumerate(trace):
        if -(-(r.prompt_tokens + r.max_tokens) // rig.block_size) > rig.num_kv_blocks:
            raise ValueError(f"trace request {i} ({r.prompt_tokens} + {r.max_tokens} tokens) cannot fit in "
                             f"{rig.name}'s KV pool of {rig.num_kv_blocks} blocks")


def _result(run: _Run, trace, label: str) -> SimResult:
    done = run.done
    completed = len(done) == len(trace)
    start = min(r.arrival_s for r in trace)
    end = max((s.finish_s for s in done), default=run.now)
    return SimResult(label=label, completed=completed, makespan_s=end - start, num_requests=len(trace),
                     prompt_tokens=sum(s.req.prompt_tokens for s in done),
                     output_tokens=sum(s.req.output_tokens for s in done),
                     ttft_s=tuple(s.first_token_s - s.req.arrival_s for s in done), flips=run.flips,
                     failed_flips=run.failed, flip_time_s=run.flip_time, idle_polls_with_work=run.idle_polls,
                     reasons=MappingProxyType(dict(run.reasons)), events=tuple(run.events))
