"""Which captured layout runs next: the throughput/latency policy as a pure decision over measured inputs.

Owns: `decide` — drain semantics, break-even against a round
trip priced per leg, min dwell, a settle window after a cutover, the progress exit from a stalled
prefill layout, starvation caps as outer backstops, the failed-flip fallback and the latency mode's
cycle ceiling. Its configuration, inputs and Decision are terms.py's, the meters it reads estimators.py's;
the caller measures the inputs (inputs.py).

decide(inputs, config) is a pure function: it reads no clock, keeps no state and never returns a stay
that leaves runnable work with no phase open. Every Decision carries its reason and the numbers its rule
compared; the bar a rule applied is the bar the log reports, one value (two readings of one bar drift
apart, and then the log explains a decision that was not the one taken).

Must never: import torch, read a clock, price an unmeasured quantity as 0 (unmeasured is None).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType

from phaseflip.engine.policy.estimators import (UNPRICED, LayoutRates, LegCost, RoundTrip, direction, mirrored,
                                                round_trip)
from phaseflip.engine.policy.terms import Decision, PolicyConfig, PolicyInputs
from phaseflip.engine.validate import require


@dataclass(frozen=True)
class _View:
    """One decision's derived values: computed once, so a bar is one value from one place."""
    w: PolicyInputs
    c: PolicyConfig
    here: str
    there: str
    out: LegCost             # here -> there
    rt: RoundTrip

    @classmethod
    def of(cls, w: PolicyInputs, c: PolicyConfig) -> "_View":
        require(w.active in (c.prefill_layout, c.decode_layout),
                f"active layout {w.active!r} is neither {c.prefill_layout!r} nor {c.decode_layout!r}")
        here, there = w.active, c.other(w.active)
        out, back = _leg(w, here, there), _leg(w, there, here)
        out, back = mirrored(out, back), mirrored(back, out)
        return cls(w, c, here, there, out, round_trip(out, back))

    def rates(self, layout: str) -> LayoutRates:
        return self.w.rates.get(layout) or LayoutRates(layout, None)

    def rates_provenance(self) -> dict:
        """Where the rates a priced rule compared came from (measured here, seeds of an earlier run)."""
        return {layout: self.rates(layout).provenance for layout in (self.here, self.there)}

    def home(self, layout: str) -> tuple[bool, bool]:
        return (True, False) if layout == self.c.prefill_layout else (False, True)

    def stay(self, reason: str, phases: tuple[bool, bool], numbers: dict) -> Decision:
        return Decision("stay", self.here, reason, phases[0], phases[1], MappingProxyType(dict(numbers)))

    def flip(self, reason: str, numbers: dict) -> Decision:
        prefill, decode = self.home(self.there)
        return Decision("flip", self.there, reason, prefill, decode, MappingProxyType(dict(numbers)))

    def dwell_left_s(self) -> float:
        return self.c.min_dwell_s - (self.w.now_s - self.w.progress.layout_since_s)


def _leg(w: PolicyInputs, source: str, target: str) -> LegCost:
    name = direction(source, target)
    return w.legs.get(name) or LegCost(name, None, None, UNPRICED, 0)


def decide(inputs: PolicyInputs, config: PolicyConfig) -> Decision:
    """Stay (with the phases the active layout may run) or flip, with the reason and its numbers."""
    v = _View.of(inputs, config)
    decision = _idle(v) or _failed_flip(v) or _settle(v)
    if decision is None:
        decision = _from_prefill_layout(v) if v.here == config.prefill_layout else _from_decode_layout(v)
    return _never_idle(decision, inputs)


def _idle(v: _View) -> Decision | None:
    if v.w.pending_prefill_tokens or v.w.num_running:
        return None
    return v.stay("idle: no work", v.home(v.here), {})


def _failed_flip(v: _View) -> Decision | None:
    """After a failed flip, run everything here for a bound that doubles per failure: a failure degrades
    to the fallback, never to a wedge."""
    p = v.w.progress
    if p.failed_flips_in_row == 0:
        return None
    bound = min(v.c.failed_flip_backoff_polls * 2 ** (p.failed_flips_in_row - 1), v.c.max_backoff_polls)
    if p.polls_since_failed_flip >= bound:
        return None
    return v.stay("flip failed: run here", (True, True), {
        "failed_flips_in_row": p.failed_flips_in_row, "polls_since_failed_flip": p.polls_since_failed_flip,
        "bound_polls": bound})


def _settle(v: _View) -> Decision | None:
    """A layout just cut over to is not judged until it had the chance to run (it is empty at first, and
    judged then it looks useless: the flip back ping-pongs)."""
    polls = v.w.progress.polls_in_layout
    if polls >= v.c.settle_polls:
        return None
    return v.stay("settle", v.home(v.here), {"polls_in_layout": polls, "bound_polls": v.c.settle_polls})


def _from_prefill_layout(v: _View) -> Decision:
    """Drain: prefill until nothing admissible is left (or prefill stalls, or decodes starve), then send
    the carried bundle to the decode layout if it saves more than a round trip, else decode it here.
    A bundle measured decoding here no slower than there is not held back: it decodes beside the prefill."""
    w = v.w
    if w.num_carried_decodes == 0:
        return v.stay("prefill", (True, False), {"num_carried_decodes": 0})
    trigger, numbers = _prefill_side_trigger(v)
    here_s, there_s = _bundle_decode_s(v)
    if trigger is None:
        if here_s is not None and there_s is not None and here_s <= there_s:
            # the bundle decodes here no slower than there: holding it back for a flip gains nothing,
            # and its decodes ride the prefill steps
            return v.stay("prefill, decode here: not faster there", (True, True),
                          {**numbers, "work_here_s": here_s, "work_there_s": there_s,
                           "rates_provenance": v.rates_provenance()})
        return v.stay("drain: prefill first", (True, False), numbers)
    if here_s is None and trigger in ("drained", "kv-full"):
        # Nothing admissible: the next steps here are pure decodes, and one of them prices decoding here
        # (a flip that never learned this price would leave for the home layout every time).
        return v.stay("measure decode here", (False, True), {**numbers, "work_here_s": None, "work_there_s": there_s})
    return _flip_if_worth(v, trigger, here_s, there_s, numbers, backstop=trigger == "decode-starved")


def _bundle_decode_s(v: _View) -> tuple[float | None, float | None]:
    """Seconds to decode the carried bundle here and there, at its batch (None: unmeasured)."""
    w = v.w
    return tuple(v.rates(layout).decode_s(w.carried_decode_tokens, w.num_carried_decodes)
                 for layout in (v.here, v.there))


def _prefill_side_trigger(v: _View) -> tuple[str | None, dict]:
    w, c, p = v.w, v.c, v.w.progress
    decode_wait_s = 0.0 if p.decodes_waiting_since_s is None else w.now_s - p.decodes_waiting_since_s
    numbers = {"pending_prefill_tokens": w.pending_prefill_tokens,
               "admissible_prefill_tokens": w.admissible_prefill_tokens,
               "num_carried_decodes": w.num_carried_decodes, "free_kv_blocks": w.free_kv_blocks,
               "bundle_kv_blocks": w.bundle_kv_blocks, "polls_without_prefill": p.polls_without_prefill,
               "stall_polls": c.stall_polls, "decode_wait_s": decode_wait_s,
               "max_decode_wait_s": c.max_decode_wait_s}
    if decode_wait_s >= c.max_decode_wait_s:
        return "decode-starved", numbers
    if w.admissible_prefill_tokens == 0:
        return ("drained" if w.pending_prefill_tokens == 0 else "kv-full"), numbers
    if p.polls_without_prefill >= c.stall_polls:
        return "stalled", numbers
    return None, numbers


def _from_decode_layout(v: _View) -> Decision:
    """Decode the bundle, holding prefill back while a full prefill phase would save hold_gain round trips
    (so the prefill layout gets a batch worth its flip); go back once the admissible prefill saves that.
    When the bundle has thinned (below thin_fraction of its peak), drained, or the prefill starves, or
    when holding cannot pay, do the prefill where it is cheaper: there if that saves a round trip, else
    here. Latency mode may leave earlier, at the oldest prompt's deadline."""
    w, c = v.w, v.c
    if w.admissible_prefill_tokens == 0:
        return _decode_where_cheaper(v)
    if c.mode == "latency":
        decision = _ttft_deadline(v)
        if decision is not None:
            return decision
    p = w.progress
    prefill_wait_s = 0.0 if p.prefill_waiting_since_s is None else w.now_s - p.prefill_waiting_since_s
    thin_batch = c.thin_fraction * p.peak_carried_in_layout
    here, there = v.rates(v.here), v.rates(v.there)
    numbers = {"admissible_prefill_tokens": w.admissible_prefill_tokens,
               "fillable_prefill_tokens": w.fillable_prefill_tokens,
               "num_carried_decodes": w.num_carried_decodes, "thin_batch": thin_batch,
               "prefill_wait_s": prefill_wait_s, "max_prefill_wait_s": c.max_prefill_wait_s}
    if prefill_wait_s >= c.max_prefill_wait_s:
        return _place_prefill(v, "prefill-starved", numbers, backstop=True)
    if w.num_carried_decodes <= thin_batch:
        return _place_prefill(v, "drained" if w.num_carried_decodes == 0 else "bundle thinned", numbers)
    full = _saving(here.prefill_s(w.fillable_prefill_tokens), there.prefill_s(w.fillable_prefill_tokens))
    hold_bar = None if v.rt.seconds is None else c.hold_gain * v.rt.seconds
    numbers.update(full_phase_saving_s=full, hold_bar_s=hold_bar)
    if full is not None and hold_bar is not None and full <= hold_bar:
        return _place_prefill(v, "holding cannot pay", numbers)
    held = (here.prefill_s(w.admissible_prefill_tokens), there.prefill_s(w.admissible_prefill_tokens))
    decision = _flip_if_worth(v, "prefill waits", *held, numbers, gain=c.hold_gain)
    if decision.action == "stay":
        return v.stay("drain: decode the bundle", (False, True), decision.numbers)
    return decision


def _decode_where_cheaper(v: _View) -> Decision:
    """Nothing to prefill: decode here, unless the other layout was measured decoding this bundle faster
    by more than a round trip (on a rig where the decode layout's collectives cost more than they save).
    Unpriced, the decode layout is the bundle's home: it stays."""
    here_s, there_s = _bundle_decode_s(v)
    saving_s = _saving(here_s, there_s)
    numbers = {"admissible_prefill_tokens": 0, "work_here_s": here_s, "work_there_s": there_s,
               "saving_s": saving_s, "round_trip_s": v.rt.seconds, "round_trip_provenance": v.rt.provenance,
               "rates_provenance": v.rates_provenance()}
    if saving_s is None or v.rt.seconds is None or saving_s <= v.rt.seconds:
        return v.stay("decode", (False, True), numbers)
    if v.dwell_left_s() > 0:
        return v.stay("decode: min dwell", (False, True), {**numbers, **_dwell_numbers(v)})
    return v.flip("decode cheaper there", numbers)


def _place_prefill(v: _View, trigger: str, numbers: dict, backstop: bool = False) -> Decision:
    """Run the admissible prefill where it is cheaper: there if it saves a round trip, or if together with
    the prefill this layout already ran since the cutover (its regret) it saves hold_gain round trips."""
    w, here, there = v.w, v.rates(v.here), v.rates(v.there)
    now = (here.prefill_s(w.admissible_prefill_tokens), there.prefill_s(w.admissible_prefill_tokens))
    taken = w.admissible_prefill_tokens + w.progress.prefill_tokens_in_layout
    regret = (here.prefill_s(taken), there.prefill_s(taken))
    if not _pays(v, *now, 1.0) and _pays(v, *regret, v.c.hold_gain):
        return _flip_if_worth(v, f"{trigger} + prefill regret", *regret,
                              {**numbers, "prefill_tokens_in_layout": w.progress.prefill_tokens_in_layout},
                              gain=v.c.hold_gain, backstop=backstop)
    return _flip_if_worth(v, trigger, *now, numbers, backstop=backstop)


def _ttft_deadline(v: _View) -> Decision | None:
    """The cycle ceiling flip cost sets (a cycle long enough to pay its flips may be too long for a
    prompt's first token), per request: leave the decode layout when the oldest waiting prompt,
    after the worst recent leg back and the prefill queue, would just make the budget. If prefilling here
    is sooner than flipping (the window closed: no cycle fits), prefill here instead."""
    w, budget = v.w, v.c.ttft_budget_s
    leg_s = v.out.high_s
    queue_there = v.rates(v.there).prefill_s(w.admissible_prefill_tokens)
    queue_here = v.rates(v.here).prefill_s(w.admissible_prefill_tokens)
    priced = leg_s is not None and queue_there is not None
    bar_s = budget - leg_s - queue_there if priced else 0.0
    oldest = w.oldest_wait_s or 0.0
    numbers = {"ttft_budget_s": budget, "oldest_wait_s": oldest, "leg_high_s": leg_s,
               "leg_provenance": v.out.provenance, "queue_there_s": queue_there, "queue_here_s": queue_here,
               "bar_s": bar_s}
    if w.oldest_wait_s is None or oldest < bar_s:
        return None
    if priced and queue_here is not None and queue_here <= leg_s + queue_there:
        return v.stay("ttft-deadline: prefill here is sooner", (True, True), numbers)
    return v.flip("ttft-deadline" if priced else "ttft-deadline (unpriced)", numbers)


def _saving(here_s: float | None, there_s: float | None) -> float | None:
    return None if here_s is None or there_s is None else here_s - there_s


def _pays(v: _View, here_s: float | None, there_s: float | None, gain: float) -> bool:
    """The break-even test of _flip_if_worth, for choosing between candidate flips before taking one."""
    saving_s = _saving(here_s, there_s)
    return saving_s is None or v.rt.seconds is None or saving_s > gain * v.rt.seconds


def _flip_if_worth(v: _View, trigger: str, here_s: float | None, there_s: float | None, numbers: dict,
                   gain: float = 1.0, backstop: bool = False) -> Decision:
    """Break-even: flip when the work waiting for the other layout saves more than `gain` round trips
    (the bar). An unpriced saving or round trip follows the drain rule. A flip that does not pay, or one
    inside the min dwell (backstops excepted), runs the work here instead."""
    saving_s = _saving(here_s, there_s)
    bar_s = None if v.rt.seconds is None else gain * v.rt.seconds
    numbers = {**numbers, "work_here_s": here_s, "work_there_s": there_s, "saving_s": saving_s,
               "round_trip_s": v.rt.seconds, "round_trip_provenance": v.rt.provenance, "bar_s": bar_s,
               "rates_provenance": v.rates_provenance()}
    if not _pays(v, here_s, there_s, gain):
        return v.stay(f"{trigger}: below break-even, run here", (True, True), numbers)
    if not backstop and v.dwell_left_s() > 0:
        return v.stay(f"{trigger}: min dwell, run here", (True, True), {**numbers, **_dwell_numbers(v)})
    unpriced = saving_s is None or bar_s is None
    return v.flip(f"{trigger} (unpriced)" if unpriced else trigger, numbers)


def _dwell_numbers(v: _View) -> dict:
    return {"time_in_layout_s": v.w.now_s - v.w.progress.layout_since_s, "min_dwell_s": v.c.min_dwell_s}


def _never_idle(d: Decision, w: PolicyInputs) -> Decision:
    """A stay must leave a phase open that has work, whenever any work can run (never a wedge)."""
    can_prefill, can_decode = w.admissible_prefill_tokens > 0, w.num_carried_decodes > 0
    if d.action == "flip" or (d.prefill and can_prefill) or (d.decode and can_decode):
        return d
    if not (can_prefill or can_decode):
        return d
    return replace(d, prefill=d.prefill or can_prefill, decode=d.decode or can_decode,
                   reason=f"{d.reason} (+open: nothing else runs here)")

