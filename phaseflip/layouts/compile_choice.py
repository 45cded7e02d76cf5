"""Which backend each role and bucket of a layout's step runs: compiled by inductor or eager, measured.

Owns: `CompileChoice`, the part of LayoutRunner that compiles its roles at boot and chooses per bucket:
on the CPU by timing the compiled call against the eager one (`prepare_compiled`, `_measure`, the
one-row head in `_prepare_head`); on CUDA with compile="auto" by capturing both as CUDA graphs and
timing their replays (`_choose_by_replay`, from `capture_all`). It fills the runner's `choices`
((role, bucket) -> "compiled" | "eager"), `compiled_steps`, `compiled_head` and `compile_report` (every
choice with the numbers it was made from), and reads the runner's step function, buffers and shapes.
"""
from __future__ import annotations

import functools
import time

import torch

from phaseflip.graphs.capture import StepKey, capture_cuda
from phaseflip.graphs.compile import compile_region, compile_whole_step, time_alternating, time_replays
from phaseflip.kernels.linear import GEMV_ROWS, gemv_reduces
from phaseflip.layouts.forward import compute_logits, decoder_layer
from phaseflip.layouts.messages import Phase


class CompileChoice:
    """Mixed into LayoutRunner (which sets choices, compiled_steps, compiled_head, compile_report,
    measure_graphs and provides step_fn, _phase_sizes, _sizes, _views, buffers, weights, shard)."""

    def _compiled_steps(self, cuda: bool) -> dict[Phase, object]:
        """The compiled step of each role. Prefill (and every role on CUDA, where a CUDA graph replays
        the step and host overhead is gone anyway): the decoder layer compiled once, reused by every
        layer and bucket. CPU decode: the whole step, every layer in ONE graph: per layer, graph entry,
        guard checks and wrapper calls would be a sizeable share of a batch-1 token; with inductor's
        wrapper in C++ (compile_whole_step) the step is faster still. Its graphs (batch 1, 2, and one
        dynamic graph for the larger buckets) take tens of seconds each to compile cold, seconds to load
        warm."""
        layer_step = functools.partial(self.step_fn, layer_fn=compile_region(decoder_layer))
        return {Phase.PREFILL: layer_step, Phase.DECODE: layer_step if cuda else compile_whole_step(self.step_fn)}

    def prepare_compiled(self, mode: str, cuda: bool) -> None:
        """Compile each role's step (boot only; see _compiled_steps). compile="on", and CUDA: every step
        runs compiled. "auto" on the CPU: the decode step at 1 and 2 rows and at its largest bucket, and
        the prefill role at its smallest bucket, keep the compiled step only where it is measured
        faster than eager; a bucket between takes the choice of the largest (they share its dynamic
        graph). At 1 row the eager step runs the fused layers where they serve (kernels/fused_layer.py),
        so there this sets inductor's step against the hand-written one. "auto" on CUDA: every bucket is
        measured as CUDA graphs at capture (_choose_by_replay). Every choice is reported with the
        numbers it was made from."""
        if mode == "off":
            for phase in Phase:
                self.compile_report[phase.value] = {"choice": "eager", "reason": "compile='off'"}
            return
        self.compiled_steps = self._compiled_steps(cuda)
        measure = mode == "auto" and not cuda
        self.measure_graphs = mode == "auto" and cuda
        if not cuda and self.shard.has_head:
            self._prepare_head(measure)
        for phase in Phase:
            t0 = time.perf_counter()
            sizes = self._phase_sizes(phase)
            # the buckets timed at boot: decode at 1 row (its own graph: 0/1 specialisation), 2 rows
            # (the dynamic graph's first size) and the largest, since from 4 rows up the two measure
            # within a few % at every bucket and timing each bucket costs seconds of boot; prefill at its
            # smallest bucket (its dynamic graph serves the others; larger chunks are GEMM-bound)
            probed = (sizes[:2] + sizes[2:][-1:]) if phase is Phase.DECODE else sizes[:1]
            compiled = self.compiled_steps[phase]
            report = {b: self._measure(compiled, self._views(sz), measure) for b, sz in probed}
            for b, _ in sizes:
                self.choices[(phase.value, b)] = report.get(b, report[probed[-1][0]])["choice"]
            unprobed = [sz for b, sz in sizes if b not in report and self.choices[(phase.value, b)] == "compiled"]
            if unprobed:  # a second size makes the token dimension dynamic: that graph, which serves
                compiled(self._views(unprobed[0]))  # every larger bucket, compiles now, not mid-serving
            picked = {self.choices[(phase.value, b)] for b, _ in sizes}
            self.compile_report[phase.value] = {
                "choice": picked.pop() if len(picked) == 1 else "per bucket",
                "boot_ms": (time.perf_counter() - t0) * 1e3, "buckets": report,
                "rule": ("measured: decode at 1, 2 and its largest bucket (those between take the largest's "
                         "choice); prefill at its smallest bucket, for all" if measure
                         else f"compile={mode!r}{' on cuda' if cuda else ''}: compiled everywhere")}

    def _prepare_head(self, measure: bool) -> None:
        """The LM head for a decode that samples up to GEMV_ROWS rows (CPU): inductor's one pass over
        the head where it is measured faster (or compile="on"), else the eager product. Where one-row
        products were measured faster eager (linear_forms.choose_gemv) a compiled head is the same call: none."""
        if not gemv_reduces(self.weights.lm_head.dtype):
            self.compile_report["head"] = {"choice": "eager",
                                           "reason": "one-row products run eager (measured)"}
            return
        compiled = compile_region(compute_logits)
        rows = {"hidden_in": self.buffers.tensors["hidden_in"][:GEMV_ROWS]}
        head = self.weights.lm_head
        report = self._measure(lambda v: compiled(head, v["hidden_in"]), rows, measure,
                               lambda v: compute_logits(head, v["hidden_in"]))
        self.compiled_head = compiled if report["choice"] == "compiled" else None
        self.compile_report["head"] = report

    def _measure(self, compiled, views: dict[str, torch.Tensor], measure: bool, eager=None) -> dict:
        """One bucket: the first compiled call (it compiles when no earlier bucket had these guards),
        then, when measuring, the best of a few calls of each, compiled and eager timed in turn (timed
        one after the other, a cold boot's compile work can make the faster step time as the slower,
        and the boot then serves the slower)."""
        t0 = time.perf_counter()
        compiled(views)
        first_ms = (time.perf_counter() - t0) * 1e3
        if not measure:
            return {"choice": "compiled", "first_call_ms": first_ms, "compiled_ms": None, "eager_ms": None}
        ms = time_alternating({"compiled": compiled, "eager": eager or self.step_fn}, views)
        compiled_ms, eager_ms = ms["compiled"], ms["eager"]
        return {"choice": "compiled" if compiled_ms < eager_ms else "eager", "first_call_ms": first_ms,
                "compiled_ms": compiled_ms, "eager_ms": eager_ms}

    def _choose_by_replay(self, pool, stream) -> None:
        """compile="auto" on CUDA: each bucket's compiled and uncompiled step captured as CUDA graphs and
        replayed (uncaptured, the eager step would pay a launch per kernel: no fair comparison); the
        faster is kept and the report gives both times. The two graphs are dropped (their memory goes
        back to the pool) before the kept step's variants are captured."""
        for phase in Phase:
            report = self.compile_report[phase.value]
            for bucket, sizes in self._phase_sizes(phase):
                if self.choices.get((phase.value, bucket)) != "compiled":
                    continue
                key = StepKey(self.layout, phase.value, bucket)
                ms = {backend: time_replays(capture_cuda(key, fn, self.buffers, self._sizes(sizes), pool, stream))
                      for backend, fn in (("compiled", self.compiled_steps[phase]), ("eager", self.step_fn))}
                choice = "compiled" if ms["compiled"] <= ms["eager"] else "eager"
                self.choices[(phase.value, bucket)] = choice
                buckets = report.setdefault("buckets", {})
                buckets[bucket] = {**buckets.get(bucket, {}), "choice": choice, "compiled_ms": ms["compiled"],
                                   "eager_ms": ms["eager"]}
            picked = {self.choices[(phase.value, b)] for b, _ in self._phase_sizes(phase)}
            report["choice"] = picked.pop() if len(picked) == 1 else "per bucket"
            report["rule"] = ("measured on CUDA: every bucket's compiled and uncompiled step as CUDA graphs, "
                              "replayed (ms per replay); the faster kept")
