"""The catalogue of captured steps: bucket lookup for replay, and the list `inspect` reports.

Owns: GraphRegistry. Lookup picks the smallest captured bucket >= the live size; a size above every
bucket is run by the caller (as chunks of the largest, or uncaptured) and counted here.
"""
from __future__ import annotations

import bisect
from collections import Counter

from phaseflip.graphs.capture import CapturedStep, StepKey


class GraphRegistry:
    def __init__(self):
        self._steps: dict[StepKey, CapturedStep] = {}
        self._buckets: dict[tuple[str, str], list[int]] = {}
        self.eager_fallbacks: Counter = Counter()   # (layout, phase) -> uncaptured runs
        self.chunked_runs: Counter = Counter()      # (layout, phase) -> runs as chunks of the largest bucket
        self.micro_batched_runs: Counter = Counter()  # (layout, phase) -> PP steps run as micro-batches
        self.captures_at_boot = 0
        self.captures_after_boot = 0   # must stay 0: restore, never rebuild
        self._sealed = False

    def seal(self) -> None:
        """Boot is over: any capture from now on is counted as a rebuild."""
        self._sealed = True

    def add(self, step: CapturedStep) -> None:
        k = step.key
        if k in self._steps:
            raise ValueError(f"step {k} is already captured")
        self._steps[k] = step
        if self._sealed:
            self.captures_after_boot += 1
        else:
            self.captures_at_boot += 1
        bisect.insort(self._buckets.setdefault((k.layout, k.phase), []), k.bucket)

    def lookup(self, layout: str, phase: str, size: int) -> CapturedStep | None:
        buckets = self._buckets.get((layout, phase), [])
        i = bisect.bisect_left(buckets, size)
        if i == len(buckets):
            self.eager_fallbacks[(layout, phase)] += 1
            return None
        return self._steps[StepKey(layout, phase, buckets[i])]

    def largest(self, layout: str, phase: str) -> int | None:
        buckets = self._buckets.get((layout, phase))
        return buckets[-1] if buckets else None

    def steps(self) -> list[CapturedStep]:
        return list(self._steps.values())

    def __len__(self) -> int:
        return len(self._steps)
