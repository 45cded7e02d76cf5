"""Capture of a step callable over static buffers, keyed by a small descriptor; replay by key.

Owns: StepKey and CapturedStep, and the backends that record a step:
  - "eager" (CPU): the recorded step is the callable bound to the bucket's buffer views; replay calls it.
  - "cuda": arrives with the CUDA path; same interface (capture once, replay = copy inputs + replay).
Knows nothing of models or layouts beyond the opaque `layout` string in the key.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from phaseflip.graphs.buffers import StaticBuffers

StepFn = Callable[[dict[str, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class StepKey:
    layout: str   # e.g. "single", "pp", "tp"
    phase: str    # "prefill" | "decode"
    bucket: int   # tokens (prefill) or sequences (decode)


@dataclass
class CapturedStep:
    key: StepKey
    backend: str
    views: dict[str, torch.Tensor]
    run: Callable[[], torch.Tensor]
    capture_ms: float
    pool_bytes: int | None = None          # graph pool bytes; None where not measured (CPU)
    replays: int = field(default=0)

    def replay(self) -> torch.Tensor:
        self.replays += 1
        return self.run()

    def buffer_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self.views.items()}


def capture_eager(key: StepKey, fn: StepFn, buffers: StaticBuffers, sizes: dict[str, int],
                  warmup: bool = False) -> CapturedStep:
    """Record a step on the CPU: bind fn to the bucket's views. An eager step has nothing to record,
    so the warm-up run (which proves the step runs at this size) is optional: on the CPU it costs a
    full forward per bucket."""
    t0 = time.perf_counter()
    views = buffers.views(sizes)
    if warmup:
        fn(views)
    return CapturedStep(key=key, backend="eager", views=views, run=lambda: fn(views),
                        capture_ms=(time.perf_counter() - t0) * 1e3)
