"""Capture of a step callable over static buffers, keyed by a small descriptor; replay by key.

Owns: StepKey and CapturedStep, and the backends that record a step:
  - "eager" / "compiled" (CPU): the recorded step is the (compiled) callable bound to the bucket's
    buffer views; replay calls it. An eager step may instead be replayed on exact-size inputs.
  - "cuda": a torch.cuda.CUDAGraph captured over the same views after a warm-up, on a side stream, in
    the memory pool the caller passes (one per rank, shared by every layout's graphs).
Replay = copy inputs into the views (the caller) + replay. Knows nothing of models or layouts beyond
the opaque `layout` string in the key.
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
    pool_bytes: int | None = None          # graph pool bytes this capture added; None where not measured
    replays: int = field(default=0)
    graph: object | None = None            # the torch.cuda.CUDAGraph (cuda backend)
    fn: StepFn | None = None               # the step itself, for an eager step (shape-polymorphic)

    @property
    def exact_size(self) -> bool:
        """Whether replay may be handed exact-size inputs instead of the padded bucket: an eager step
        has no recorded shape, and on the CPU every padding row is wasted arithmetic."""
        return self.backend == "eager" and self.fn is not None

    def replay(self, exact: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        self.replays += 1
        if exact is not None:
            if not self.exact_size:
                raise ValueError(f"{self.key}: a {self.backend} step replays its bucket's views only")
            return self.fn(exact)
        return self.run()

    def buffer_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self.views.items()}


def capture_eager(key: StepKey, fn: StepFn, buffers: StaticBuffers, sizes: dict[str, int],
                  warmup: bool = False, backend: str = "eager") -> CapturedStep:
    """Record a step on the CPU: bind fn to the bucket's views. An eager step has nothing to record,
    so the warm-up run (which proves the step runs at this size) is optional: on the CPU it costs a
    full forward per bucket."""
    t0 = time.perf_counter()
    views = buffers.views(sizes)
    if warmup:
        fn(views)
    return CapturedStep(key=key, backend=backend, views=views, run=lambda: fn(views),
                        capture_ms=(time.perf_counter() - t0) * 1e3, fn=fn if backend == "eager" else None)


def capture_cuda(key: StepKey, fn: StepFn, buffers: StaticBuffers, sizes: dict[str, int], pool,
                 stream, warmup_iters: int = 2) -> CapturedStep:
    """Capture fn over the bucket's views as a CUDA graph (warm-up first: lazy init, autotuning and
    compilation must not happen inside the capture)."""
    t0 = time.perf_counter()
    views = buffers.views(sizes)
    device = next(iter(views.values())).device
    torch.cuda.synchronize(device)
    reserved = torch.cuda.memory_reserved(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup_iters):
            fn(views)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = fn(views)
    torch.cuda.synchronize(device)

    def run() -> torch.Tensor:
        graph.replay()
        return out
    return CapturedStep(key=key, backend="cuda", views=views, run=run,
                        capture_ms=(time.perf_counter() - t0) * 1e3,
                        pool_bytes=torch.cuda.memory_reserved(device) - reserved, graph=graph)
