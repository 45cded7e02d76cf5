"""The terms of a layout decision: the policy's configuration, what it reads, what it returns.

Owns: PolicyConfig (validated at construction: a bad value is named with what is allowed), PolicyInputs
(everything decide() may read, measured by the caller at the moment of the decision) and Decision (the
layout that runs next, the phases it opens, the reason and the numbers the rule compared, as logged).
The rules that map the one onto the other are decide.py's.

Must never: import torch, read a clock.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from phaseflip.engine.policy.estimators import LayoutRates, LegCost, Progress
from phaseflip.engine.validate import is_number, require

MODES = ("throughput", "latency")


@dataclass(frozen=True)
class PolicyConfig:
    mode: str = "throughput"            # throughput | latency
    ttft_budget_s: float | None = None  # latency mode only: the time-to-first-token budget
    prefill_layout: str = "pp"          # the layout whose home phase is prefill
    decode_layout: str = "tp"           # the layout whose home phase is decode
    settle_polls: int = 2               # polls after a cutover before the new layout may be judged
    min_dwell_s: float = 0.5            # no economic exit before this long in a layout
    stall_polls: int = 4                # k chunk cadences without prefill while decodes are carried
    max_decode_wait_s: float = 60.0     # outer backstop: carried decodes never wait longer in prefill
    max_prefill_wait_s: float = 60.0    # outer backstop: admissible prefill never waits longer in decode
    thin_fraction: float = 0.5          # the decode layout holds prefill back while the batch keeps this
                                        # share of its peak since the cutover
    hold_gain: float = 3.0              # ... or until the prefill held back saves hold_gain round trips
    failed_flip_backoff_polls: int = 8  # polls in the fallback after a failed flip; doubles per failure
    max_backoff_polls: int = 1024

    def __post_init__(self) -> None:
        require(self.mode in MODES, f"policy mode={self.mode!r} is invalid: allowed are {', '.join(MODES)}")
        if self.mode == "latency":
            require(is_number(self.ttft_budget_s) and self.ttft_budget_s > 0,
                    f"policy='latency' needs ttft_budget_s > 0, got {self.ttft_budget_s!r}")
        else:
            require(self.ttft_budget_s is None, "ttft_budget_s applies to policy='latency' only")
        require(self.prefill_layout != self.decode_layout, "prefill_layout and decode_layout must differ")
        for name in ("settle_polls", "stall_polls", "failed_flip_backoff_polls", "max_backoff_polls"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                    f"PolicyConfig.{name}={value!r} must be an int >= 1")
        for name in ("min_dwell_s", "max_decode_wait_s", "max_prefill_wait_s"):
            require(is_number(getattr(self, name)) and getattr(self, name) >= 0,
                    f"PolicyConfig.{name}={getattr(self, name)!r} must be a number >= 0")
        require(is_number(self.thin_fraction) and 0 <= self.thin_fraction < 1,
                f"PolicyConfig.thin_fraction={self.thin_fraction!r} must be in [0, 1)")
        require(is_number(self.hold_gain) and self.hold_gain >= 1,
                f"PolicyConfig.hold_gain={self.hold_gain!r} must be a number >= 1")

    def other(self, layout: str) -> str:
        return self.decode_layout if layout == self.prefill_layout else self.prefill_layout


@dataclass(frozen=True)
class PolicyInputs:
    """Everything decide() may read: measured by the caller at the moment of the decision."""
    active: str
    now_s: float
    pending_prefill_tokens: int     # prompt tokens not yet in KV: waiting + running mid-prefill
    admissible_prefill_tokens: int  # of those, what could run now: running prefills + waiting that fit
    fillable_prefill_tokens: int    # what one prefill phase could take at most: as admissible, but
                                    # as if the carried bundle's KV blocks and slots were free
    num_waiting: int
    num_running: int
    num_carried_decodes: int        # running sequences whose next step is a decode
    carried_decode_tokens: int      # tokens they are expected to generate still (OutputLengthEstimator)
    free_kv_blocks: int
    bundle_kv_blocks: int           # blocks the running sequences still need to reach max_tokens
    oldest_wait_s: float | None     # age of the oldest prompt without a first token (None: none)
    progress: Progress
    rates: Mapping[str, LayoutRates]
    legs: Mapping[str, LegCost]     # by direction "pp->tp"

    def __post_init__(self) -> None:
        for name in ("pending_prefill_tokens", "admissible_prefill_tokens", "fillable_prefill_tokens",
                     "num_waiting", "num_running",
                     "num_carried_decodes", "carried_decode_tokens", "free_kv_blocks", "bundle_kv_blocks"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 0, f"PolicyInputs.{name}={value!r} must be an int >= 0")
        require(self.admissible_prefill_tokens <= self.fillable_prefill_tokens <= self.pending_prefill_tokens,
                "need admissible_prefill_tokens <= fillable_prefill_tokens <= pending_prefill_tokens")
        require(self.num_carried_decodes <= self.num_running, "num_carried_decodes cannot exceed num_running")
        object.__setattr__(self, "rates", MappingProxyType(dict(self.rates)))
        object.__setattr__(self, "legs", MappingProxyType(dict(self.legs)))


@dataclass(frozen=True)
class Decision:
    action: str                 # stay | flip
    target: str                 # the layout that runs next (the active one for a stay)
    reason: str
    prefill: bool               # phases open in `target` until the next decision
    decode: bool
    numbers: Mapping[str, object] = field(default_factory=dict)

    def record(self, inputs: PolicyInputs) -> dict:
        """The decision-log entry: time, layout, action, reason and the numbers the rule used."""
        return {"time_s": inputs.now_s, "layout": inputs.active, "action": self.action, "target": self.target,
                "reason": self.reason, "prefill": self.prefill, "decode": self.decode,
                "numbers": dict(self.numbers)}
