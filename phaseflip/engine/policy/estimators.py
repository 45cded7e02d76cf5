"""The meters the layout policy reads: flip cost per direction, token rates per layout, output
lengths, and the progress stamps and hold counters every hold is bounded by.

Owns: FlipCostEstimator (one per direction, since the two directions cost differently; provenance
seed / half-measured / measured; a round trip is the sum of its two legs), RateEstimator (one per
layout), OutputLengthEstimator, ProgressTracker, and Meters (the four, as one policy holds them).
Unmeasured is None, never 0. No torch, no clock reads: the caller passes the times.
"""
from __future__ import annotations

import bisect
import itertools
import statistics
from collections import deque
from dataclasses import dataclass, replace
from typing import Mapping

from phaseflip.engine.validate import is_number, require

SEED, HALF, MEASURED, UNPRICED, MIRRORED = "seed", "half-measured", "measured", "unpriced", "mirrored"


def direction(source: str, target: str) -> str:
    return f"{source}->{target}"


# -- flip cost, per direction (one blended figure misprices both) --------------------------------------
@dataclass(frozen=True)
class LegCost:
    """One direction's price: `seconds` (median of the recent totals, else the seed, else None),
    `high_s` (the worst recent total: what a deadline must allow for) and where it came from."""
    direction: str
    seconds: float | None
    high_s: float | None
    provenance: str          # seed | measured | unpriced
    num_measured: int


@dataclass(frozen=True)
class RoundTrip:
    seconds: float | None    # the sum of the two legs; None when either leg is unpriced, never 0
    provenance: str          # seed | half-measured | measured | unpriced


class FlipCostEstimator:
    """Measured flip totals of ONE direction: the median of the last `window` (cutover times spread so
    widely that a mean would lie), seeded by a prior until the first measurement arrives."""

    def __init__(self, direction: str, seed_s: float | None = None, window: int = 5):
        require(seed_s is None or (is_number(seed_s) and seed_s > 0),
                f"FlipCostEstimator({direction!r}): seed_s={seed_s!r} must be > 0 or None")
        require(isinstance(window, int) and window >= 1, f"window={window!r} must be an int >= 1")
        self.direction = direction
        self.seed_s = seed_s
        self._totals: deque[float] = deque(maxlen=window)

    def observe(self, total_s: float) -> None:
        require(is_number(total_s) and total_s > 0, f"flip {self.direction}: total_s={total_s!r} must be > 0")
        self._totals.append(float(total_s))

    def reading(self) -> LegCost:
        if self._totals:
            return LegCost(self.direction, statistics.median(self._totals), max(self._totals), MEASURED,
                           len(self._totals))
        provenance = UNPRICED if self.seed_s is None else SEED
        return LegCost(self.direction, self.seed_s, self.seed_s, provenance, 0)


def mirrored(leg: LegCost, opposite: LegCost) -> LegCost:
    """An unpriced leg priced by its measured opposite until it is measured itself: a flip carries the
    same live KV either way and refills the other layout's weights, so the way back is the best figure
    there is; without it the first flip could never be priced for its return."""
    if leg.seconds is not None or opposite.provenance != MEASURED:
        return leg
    return LegCost(leg.direction, opposite.seconds, opposite.high_s, MIRRORED, 0)


def round_trip(out: LegCost, back: LegCost) -> RoundTrip:
    """Price a round trip as the sum of its two legs, never as a blend of them."""
    if out.seconds is None or back.seconds is None:
        return RoundTrip(None, UNPRICED)
    measured = (out.provenance == MEASURED) + (back.provenance == MEASURED)
    return RoundTrip(out.seconds + back.seconds, (SEED, HALF, MEASURED)[measured])


# -- layout speed (calibrated at boot, updated online) -----------------------------------------------
@dataclass(frozen=True)
class LayoutRates:
    """One layout's speed: prefill tokens/s and decode step seconds per batch size (None: unmeasured),
    and where they came from: measured in this run, seeds (an earlier run's record, the simulator's
    rig), both, or unpriced (nothing known)."""
    layout: str
    prefill_tok_s: float | None
    decode_step_s: tuple[tuple[int, float], ...] = ()   # (batch, seconds), batch ascending
    provenance: str = MEASURED

    def prefill_s(self, tokens: int) -> float | None:
        return None if self.prefill_tok_s is None else tokens / self.prefill_tok_s

    def step_s(self, batch: int) -> float | None:
        """Decode step seconds at `batch`: linear between measured batches, flat below the smallest, and
        above the largest along the last two measured batches' slope (never cheaper than the largest).
        Above a single measured batch it is unmeasured (None): a step's time is a fixed part (the
        weights read, the collectives) plus a part per sequence, and one point cannot tell them apart
        (taken as all per sequence, a batch-1 step priced a batch of 32 at 32 steps)."""
        points = self.decode_step_s
        if not points or batch < 1:
            return None
        if batch <= points[0][0]:
            return points[0][1]
        for (b0, s0), (b1, s1) in zip(points, points[1:]):
            if batch <= b1:
                return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)
        if len(points) < 2:
            return None
        (b0, s0), (b_max, s_max) = points[-2:]
        return s_max + max(0.0, (s_max - s0) / (b_max - b0)) * (batch - b_max)

    def decode_s(self, tokens: int, batch: int) -> float | None:
        """Seconds to generate `tokens` tokens at a batch of `batch` sequences."""
        step = self.step_s(batch)
        return None if step is None else tokens / batch * step


class RateEstimator:
    """One layout's rates: an EMA of prefill tokens/s and of decode step seconds per batch size. Mixed
    steps (prefill and decode together, the fallback) are not attributed: they teach neither rate.
    Values given at construction are seeds: their provenance is "seed" until a step of their kind
    measures them (the EMA then starts from the seed)."""

    def __init__(self, layout: str, prefill_tok_s: float | None = None,
                 decode_step_s: Mapping[int, float] | None = None, alpha: float = 0.25):
        require(0 < alpha <= 1, f"alpha={alpha!r} must be in (0, 1]")
        require(prefill_tok_s is None or (is_number(prefill_tok_s) and prefill_tok_s > 0),
                f"RateEstimator({layout!r}): prefill_tok_s={prefill_tok_s!r} must be > 0 or None")
        self.layout, self.alpha = layout, alpha
        self.prefill_tok_s = prefill_tok_s
        self._step_s: dict[int, float] = {}
        for batch, seconds in (decode_step_s or {}).items():
            self._check_step(int(batch), seconds)
            self._step_s[int(batch)] = float(seconds)
        self._seeds: set = set(self._step_s) | ({"prefill"} if prefill_tok_s is not None else set())

    def _check_step(self, batch: int, seconds: float) -> None:
        require(batch >= 1 and is_number(seconds) and seconds > 0,
                f"RateEstimator({self.layout!r}): decode step {batch} -> {seconds!r} must be batch >= 1, s > 0")

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def observe_step(self, prefill_tokens: int, decode_batch: int, seconds: float) -> None:
        if seconds <= 0 or (prefill_tokens > 0) == (decode_batch > 0):
            return  # an empty or a mixed step
        if prefill_tokens > 0:
            self.prefill_tok_s = self._ema(self.prefill_tok_s, prefill_tokens / seconds)
            self._seeds.discard("prefill")
        else:
            self._check_step(decode_batch, seconds)
            self._step_s[decode_batch] = self._ema(self._step_s.get(decode_batch), seconds)
            self._seeds.discard(decode_batch)

    def reading(self) -> LayoutRates:
        known = len(self._step_s) + (self.prefill_tok_s is not None)
        provenance = (UNPRICED if known == 0 else MEASURED if not self._seeds else SEED if len(self._seeds) == known
                      else f"{SEED}+{MEASURED}")
        return LayoutRates(self.layout, self.prefill_tok_s, tuple(sorted(self._step_s.items())), provenance)


class OutputLengthEstimator:
    """Expected decode tokens a sequence has left, from the output lengths of finished ones (the mean
    residual length of those that outgrew it); max_tokens bounds it, and is the answer until measured."""

    def __init__(self, window: int = 512):
        require(isinstance(window, int) and window >= 1, f"window={window!r} must be an int >= 1")
        self._lengths: deque[int] = deque(maxlen=window)
        self._sorted: list[int] | None = None
        self._prefix: list[int] = [0]     # prefix sums of _sorted

    def observe(self, num_output_tokens: int) -> None:
        require(isinstance(num_output_tokens, int) and num_output_tokens >= 0,
                f"num_output_tokens={num_output_tokens!r} must be an int >= 0")
        self._lengths.append(num_output_tokens)
        self._sorted = None

    def expected_left(self, generated: int, max_tokens: int) -> int:
        if self._sorted is None:
            self._sorted = sorted(self._lengths)
            self._prefix = [0, *itertools.accumulate(self._sorted)]
        lo = bisect.bisect_right(self._sorted, generated)      # lengths > generated
        hi = bisect.bisect_right(self._sorted, max_tokens)     # lengths <= max_tokens
        longer = len(self._sorted) - lo
        if longer == 0:
            return max(0, max_tokens - generated)
        capped = self._prefix[max(hi, lo)] - self._prefix[lo] + max_tokens * (len(self._sorted) - max(hi, lo))
        return max(1, round(capped / longer) - generated)


# -- progress stamps and hold counters (every hold needs a bound that advances) ------------------------
@dataclass(frozen=True)
class Progress:
    """What the caller's ProgressTracker counted; every hold of decide() is bounded by one of these."""
    layout_since_s: float              # stamp of the last cutover (or of boot)
    polls_in_layout: int               # steps + idle polls since then (bounds the settle window)
    polls_without_prefill: int         # consecutive polls that computed no prefill token (the stall exit)
    decodes_waiting_since_s: float | None  # carried decodes have made no progress since (starvation cap)
    prefill_waiting_since_s: float | None  # admissible prefill has made no progress since (starvation cap)
    peak_carried_in_layout: int        # the largest decode batch seen since the cutover
    prefill_tokens_in_layout: int      # prefill tokens computed since the cutover
    failed_flips_in_row: int
    polls_since_failed_flip: int       # bounds the failed-flip fallback


class ProgressTracker:
    """The caller's counters: call on_poll once per step or idle poll, on_cutover after a successful flip,
    on_flip_failed after a failed one; pass snapshot() to decide(). It only counts what it is told."""

    def __init__(self, now_s: float):
        self._p = Progress(now_s, 0, 0, None, None, 0, 0, 0, 0)

    def snapshot(self) -> Progress:
        return self._p

    def on_poll(self, now_s: float, prefill_tokens: int, decode_tokens: int, num_carried: int,
                admissible_prefill_tokens: int) -> None:
        """After each step or idle poll: what it computed and what is left waiting."""
        p = self._p
        self._p = replace(
            p, polls_in_layout=p.polls_in_layout + 1,
            polls_without_prefill=0 if prefill_tokens > 0 else p.polls_without_prefill + 1,
            decodes_waiting_since_s=_since(p.decodes_waiting_since_s, now_s, num_carried > 0, decode_tokens > 0),
            prefill_waiting_since_s=_since(p.prefill_waiting_since_s, now_s, admissible_prefill_tokens > 0,
                                           prefill_tokens > 0),
            peak_carried_in_layout=max(p.peak_carried_in_layout, num_carried),
            prefill_tokens_in_layout=p.prefill_tokens_in_layout + prefill_tokens,
            polls_since_failed_flip=p.polls_since_failed_flip + 1)

    def on_cutover(self, now_s: float) -> None:
        self._p = replace(self._p, layout_since_s=now_s, polls_in_layout=0, polls_without_prefill=0,
                          peak_carried_in_layout=0, prefill_tokens_in_layout=0, failed_flips_in_row=0,
                          polls_since_failed_flip=0)

    def on_flip_failed(self) -> None:
        self._p = replace(self._p, failed_flips_in_row=self._p.failed_flips_in_row + 1,
                          polls_since_failed_flip=0)


def _since(stamp: float | None, now_s: float, waiting: bool, progressed: bool) -> float | None:
    """A starvation stamp: when work began waiting without progress; None while none waits or it moves."""
    if not waiting or progressed:
        return None
    return now_s if stamp is None else stamp




@dataclass
class Meters:
    """The live meters one policy reads: progress, a rate per layout, a flip cost per direction (all
    unseeded: unpriced until measured) and the output lengths seen."""
    tracker: ProgressTracker
    rates: dict[str, RateEstimator]
    legs: dict[str, FlipCostEstimator]
    outputs: OutputLengthEstimator

    @classmethod
    def unseeded(cls, layouts: tuple[str, ...], now_s: float) -> Meters:
        return cls.seeded(layouts, now_s, {})

    @classmethod
    def seeded(cls, layouts: tuple[str, ...], now_s: float, seeds: Mapping) -> Meters:
        """Meters whose rates and flip legs start from `seeds` (what `seeds()` of an earlier run's meters
        returned; a layout or leg it lacks starts unpriced)."""
        rates, legs = seeds.get("rates", {}), seeds.get("legs", {})
        return cls(ProgressTracker(now_s),
                   {name: RateEstimator(name, rates.get(name, {}).get("prefill_tok_s"),
                                        rates.get(name, {}).get("decode_step_s")) for name in layouts},
                   {d: FlipCostEstimator(d, legs.get(d)) for d in (direction(a, b) for a in layouts for b in layouts
                                                                    if a != b)},
                   OutputLengthEstimator())

    def seeds(self) -> dict:
        """What this run's meters know, as the next run's seeds (JSON-able): each layout's rates and each
        flip direction's price (median of the measured, else its own seed)."""
        rates = {name: {"prefill_tok_s": r.prefill_tok_s, "decode_step_s": dict(r.decode_step_s)}
                 for name, r in ((n, e.reading()) for n, e in self.rates.items())}
        legs = {d: leg.seconds for d, leg in ((d, e.reading()) for d, e in self.legs.items())
                if leg.seconds is not None}
        return {"rates": rates, "legs": legs}
