"""Compiling a step function with inductor, and measuring whether it pays (CPU).

Owns: `compile_step` (torch.compile with a dynamic token dimension: one compile serves every bucket of
a role) and `time_step` (the median wall time of a step, for the eager-vs-compiled choice on the CPU,
where MEASURED.md found compiled steps no faster than eager)."""
from __future__ import annotations

import statistics
import time

import torch


def compile_step(fn):
    return torch.compile(fn, dynamic=True)


def time_step(fn, views: dict[str, torch.Tensor], repeats: int = 3) -> float:
    """Median ms of fn(views) after one untimed run (which also triggers any compilation)."""
    fn(views)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(views)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
