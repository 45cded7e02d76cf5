"""Capture of a step callable over static buffers, keyed by a small descriptor; replay by key.

Owns: StepKey and CapturedStep, and the backends that record a step:
  - "eager" / "compiled" (CPU): the recorded step is the (compiled) callable bound to the bucket's
    buffer views; replay calls it (a compiled decode step as a graphs/compile.py DirectStep, which
    calls its graph without dynamo once bound). An eager step may instead be replayed on exact-size
    inputs.
  - "cuda": a torch.cuda.CUDAGraph captured over the same views after a warm-up, on a side stream, in
    the memory pool the caller passes (one per rank, shared by every layout's graphs).
Replay = copy inputs into the views (the caller) + replay. A step may have variants (e.g. a decode
that ends in greedy ids only, or in the full sampler): one recording each over the same views (one CUDA
graph each, in the same pool); the first is the default. Knows nothing of models or layouts beyond the
opaque `layout` string in the key.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from phaseflip.graphs.buffers import StaticBuffers

StepFn = Callable[[dict[str, torch.Tensor]], object]


def _variants(fn: StepFn | dict[str, StepFn]) -> dict[str, StepFn]:
    return dict(fn) if isinstance(fn, dict) else {"step": fn}


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
    runs: dict[str, Callable[[], object]]  # variant -> its recording over `views`; the first is the default
    capture_ms: float
    pool_bytes: int | None = None          # graph pool bytes this capture added; None where not measured
    replays: int = field(default=0)
    graphs: dict[str, object] = field(default_factory=dict)   # variant -> torch.cuda.CUDAGraph (cuda)
    fns: dict[str, StepFn] | None = None   # the steps themselves, for an eager step (shape-polymorphic)

    @property
    def exact_size(self) -> bool:
        """Whether replay may be handed exact-size inputs instead of the padded bucket: an eager step
        has no recorded shape, and on the CPU every padding row is wasted arithmetic."""
        return self.backend == "eager" and self.fns is not None

    def replay(self, exact: dict[str, torch.Tensor] | None = None, variant: str | None = None):
        variant = variant or next(iter(self.runs))
        if variant not in self.runs:
            raise ValueError(f"{self.key}: no variant {variant!r}; recorded are {', '.join(self.runs)}")
        self.replays += 1
        if exact is not None:
            if not self.exact_size:
                raise ValueError(f"{self.key}: a {self.backend} step replays its bucket's views only")
            return self.fns[variant](exact)
        return self.runs[variant]()

    def buffer_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self.views.items()}


def capture_eager(key: StepKey, fn: StepFn | dict[str, StepFn], buffers: StaticBuffers, sizes: dict[str, int],
                  warmup: bool = False, backend: str = "eager") -> CapturedStep:
    """Record a step (each variant of it) on the CPU: bind it to the bucket's views. An eager step has
    nothing to record, so the warm-up run (which proves the step runs at this size) is optional: on the
    CPU it costs a full forward per bucket."""
    t0 = time.perf_counter()
    views, fns = buffers.views(sizes), _variants(fn)
    if warmup:
        for f in fns.values():
            f(views)
    return CapturedStep(key=key, backend=backend, views=views, runs={v: _bound(f, views) for v, f in fns.items()},
                        capture_ms=(time.perf_counter() - t0) * 1e3, fns=fns if backend == "eager" else None)


def _bound(fn: StepFn, views: dict[str, torch.Tensor]) -> Callable[[], object]:
    return lambda: fn(views)


def capture_cuda(key: StepKey, fn: StepFn | dict[str, StepFn], buffers: StaticBuffers, sizes: dict[str, int],
                 pool, stream, warmup_iters: int = 2) -> CapturedStep:
    """Capture each variant over the bucket's views as a CUDA graph (warm-up first: lazy init, autotuning
    and compilation must not happen inside the capture)."""
    t0 = time.perf_counter()
    views = buffers.views(sizes)
    device = next(iter(views.values())).device
    torch.cuda.synchronize(device)
    # torch.cuda.graph() empties the allocator's cache as it begins: emptied first here too, or the
    # blocks it releases would count against this capture (pool_bytes came out negative)
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved(device)
    runs, graphs = {}, {}
    for variant, f in _variants(fn).items():
        graphs[variant], out = _record(f, views, pool, stream, warmup_iters)
        runs[variant] = _replayer(graphs[variant], out)
    torch.cuda.synchronize(device)
    return CapturedStep(key=key, backend="cuda", views=views, runs=runs, capture_ms=(time.perf_counter() - t0) * 1e3,
                        pool_bytes=torch.cuda.memory_reserved(device) - reserved, graphs=graphs)


def _record(fn: StepFn, views: dict[str, torch.Tensor], pool, stream, warmup_iters: int):
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        for _ in range(warmup_iters):
            fn(views)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = fn(views)
    return graph, out


def _replayer(graph, out) -> Callable[[], object]:
    def run():
        graph.replay()
        return out
    return run
