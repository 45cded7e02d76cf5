"""Which backend each role and bucket of a layout's step runs: compiled by inductor or eager, measured.

Owns: `CompileChoice`, held by each LayoutRunner (`runner.compile`): it compiles the layout's roles at
boot and chooses per bucket: on the CPU by timing the compiled call against the eager one (`prepare`,
`_measure`, the one-row head in `_prepare_head`); on CUDA with compile="auto" by capturing both as CUDA
graphs and timing their replays (`choose_by_replay`, from the runner's capture). It keeps `choices`
((role, bucket) -> "compiled" | "eager"), `compiled_steps`, `head` and `report` (every choice with the
numbers it was made from), built from what it is given: the layout's step function, its maths inputs
(`StepState`), the static buffers and the step shapes. A boot with a record of these choices for its key
(rank/boot_record.py) takes them and measures nothing; a compiled step is kept only where it was
measured at least MIN_GAIN faster than eager.
"""
from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

from phaseflip.graphs import saved_steps
from phaseflip.graphs.buffers import StaticBuffers
from phaseflip.graphs.capture import StepKey, capture_cuda
from phaseflip.graphs.compile import compile_region, compile_whole_step, time_alternating, time_replays
from phaseflip.graphs.saved_steps import SavedLayer, SavedSteps, wrapper_options
from phaseflip.kernels.cpu import fused_layer, quant
from phaseflip.kernels.cpu import linear as cpu_linear
from phaseflip.kernels.cpu.linear import GEMV_ROWS
from phaseflip.rank.forward import StepState, compute_logits, decoder_layer, final_softcap, forward
from phaseflip.rank.boot_record import BootRecord
from phaseflip.rank.messages import Phase
from phaseflip.rank.step_inputs import bucket_rows, phase_buckets

MIN_GAIN = 0.05   # compile="auto" keeps a compiled step only this much faster than eager (compile costs boot)
# compile="auto" on the CPU does not compile the decode buckets of up to fused_layer.SURE_ROWS rows the
# fused layers run: inductor's step of such a bucket, which traces the layers as operators, was never
# measured MIN_GAIN faster than the fused call (docs/performance.md), and compiling it costs a whole-step
# compile at a cold boot
FUSED_ROWS = ("the fused layers run this bucket (kernels/cpu/fused_layer.py): inductor's step not compiled "
              "against them")
# nor a tensor-parallel step: it breaks at each all-reduce, so its graphs cannot be saved and every boot
# traces them again (~20 s of a warm boot for one decode bucket), and its measured gain at the same
# bucket ranged from 27% slower to 16% faster between cold boots (docs/performance.md)
TP_ON_CPU = "tensor-parallel on the CPU: its graphs break at each all-reduce (not saved, traced at every boot)"
# where no compiled step multiplies one row (compiles_one_row), the one-row form is not measured
ONE_ROW_UNUSED = "not measured: no step compiled here multiplies one row (the LM head is measured on its own)"


class CompileChoice:
    """One layout's compiled steps on one rank and the backend each (role, bucket) runs."""

    def __init__(self, layout: str, step_fn, state: StepState, buffers: StaticBuffers, shapes):
        self.layout, self.step_fn, self.state = layout, step_fn, state   # step_fn(meta, layer_fn=...)
        self.buffers, self.shapes = buffers, shapes                        # shapes: the runner's StepShapes
        self.choices: dict[tuple[str, int], str] = {}   # (role, bucket) -> "compiled" | "eager"
        self.compiled_steps: dict[Phase, object] = {}   # role -> its compiled step
        self.saved_steps: dict[Phase, object] = {}      # role -> its SavedSteps, where saved
        self.report: dict[str, dict] = {}               # every choice with the numbers it was made from
        self.head = None             # the LM head compiled for a GEMV_ROWS-row decode (CPU), if chosen
        self.measure_graphs = False  # compile="auto" on CUDA: choose per bucket by graph replay

    def step_for(self, phase: Phase, bucket: int) -> tuple[str, object]:
        """The backend a bucket records and its step function."""
        backend = self.choices.get((phase.value, bucket), "eager")
        return backend, self.compiled_steps[phase] if backend == "compiled" else self.step_fn

    def _views(self, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        return self.buffers.views(bucket_rows(sizes))

    def _compiled_steps(self, cuda: bool, saved_dir: Path | None) -> dict[Phase, object]:
        """The compiled step of each role. Prefill (and every role on CUDA, where a CUDA graph replays
        the step and host overhead is gone anyway): the decoder layer compiled once, reused by every
        layer and bucket. CPU decode: the whole step, every layer in ONE graph: per layer, graph entry,
        guard checks and wrapper calls would be a sizeable share of a batch-1 token; with inductor's
        wrapper in C++ the step is faster still. Where the layers reduce nothing between ranks (one
        graph, no break at a collective) and this torch saves compiled functions, both roles' graphs
        (the prefill layer's, the whole decode step's) are kept under saved_dir and a later boot loads
        them (graphs/saved_steps.py; `saved_steps`); else torch.compile traces them at every boot
        (inductor's caches keep their code), the decode step a DirectStep at capture."""
        layer_step = functools.partial(self.step_fn, layer_fn=compile_region(decoder_layer))
        if cuda:
            return {Phase.PREFILL: layer_step, Phase.DECODE: layer_step}
        if saved_dir is None or self.state.shard.tp_size > 1 or not saved_steps.available():
            return {Phase.PREFILL: layer_step, Phase.DECODE: compile_whole_step(self.step_fn)}
        self.saved_steps = {Phase.PREFILL: SavedLayer(decoder_layer, saved_dir / "prefill"),
                            Phase.DECODE: SavedSteps(forward, self.state, saved_dir / "decode",
                                                     wrapper_options())}
        return {Phase.PREFILL: functools.partial(self.step_fn, layer_fn=self.saved_steps[Phase.PREFILL]),
                Phase.DECODE: self.saved_steps[Phase.DECODE]}

    def prepare(self, mode: str, cuda: bool, record: BootRecord | None = None) -> None:
        """Compile each role's step (boot only; see _compiled_steps). compile="on", and CUDA: every step
        runs compiled. "auto" on the CPU: the decode step at 1 and 2 rows and at its largest bucket, and
        the prefill role at its smallest bucket, keep the compiled step only where it is measured at
        least MIN_GAIN faster than eager; a bucket between takes the choice of the largest (they share
        its dynamic graph). Never compiled by "auto" on the CPU: the decode buckets of up to SURE_ROWS
        rows whose eager step runs the fused layers (FUSED_ROWS; then the first bucket above them and the
        largest are measured), and a tensor-parallel layout's steps (TP_ON_CPU).
        "auto" on CUDA: every bucket is measured as CUDA graphs at capture (choose_by_replay). Where
        `record` holds an earlier boot's choices for this key (rank/boot_record.py), they are taken
        and nothing is measured: only the buckets chosen compiled are compiled (or loaded). Every
        choice is reported with the numbers it was made from."""
        eager_reason = ("compile='off'" if mode == "off" else
                        TP_ON_CPU if mode == "auto" and not cuda and self.state.shard.tp_size > 1 else None)
        if eager_reason is not None:
            for phase in Phase:
                self.report[phase.value] = {"choice": "eager", "reason": eager_reason}
            return
        self.compiled_steps = self._compiled_steps(cuda, None if record is None else record.steps_dir)
        recorded = {phase: record.get(phase.value) for phase in Phase} if record is not None else {}
        use_record = all(r is not None and "choices" in r for r in recorded.values()) and bool(recorded)
        measure = mode == "auto" and not cuda and not use_record
        self.measure_graphs = mode == "auto" and cuda and not use_record
        if not cuda and self.state.shard.has_head:
            self._prepare_head(measure, record.get("head") if use_record else None)
        for phase in Phase:
            t0 = time.perf_counter()
            if use_record:
                self._adopt(phase, recorded[phase])
            else:
                self._choose(phase, mode, measure, cuda)
            self.report[phase.value]["boot_ms"] = (time.perf_counter() - t0) * 1e3
            if phase in self.saved_steps:   # which saved graphs it loaded, which it compiled and saved
                self.report[phase.value]["saved_steps"] = self.saved_steps[phase].report

    def _choose(self, phase: Phase, mode: str, measure: bool, cuda: bool) -> None:
        """One role's choice per bucket by measurement (compile="auto" on the CPU), or compiled everywhere."""
        sizes = phase_buckets(self.shapes, phase)
        # the buckets timed at boot: decode at 1 row (its own graph: 0/1 specialisation), 2 rows (the
        # dynamic graph's first size) and the largest, since from 4 rows up the two measure within a few
        # % at every bucket and timing each bucket costs seconds of boot; where the fused layers run the
        # buckets of up to SURE_ROWS rows (FUSED_ROWS), the first above them and the largest; prefill at
        # its smallest bucket (its dynamic graph serves the others; larger chunks are GEMM-bound)
        probed = (sizes[:2] + sizes[2:][-1:]) if phase is Phase.DECODE else sizes[:1]
        report = {}
        sure = min(self.fused_rows(), fused_layer.SURE_ROWS) if phase is Phase.DECODE and measure else 0
        if sure:
            report.update({b: {"choice": "eager", "reason": FUSED_ROWS} for b, _ in sizes if b <= sure})
            above = [(b, sz) for b, sz in sizes if b > sure]
            probed = above[:1] + above[1:][-1:]
        compiled = self.compiled_steps[phase]
        report.update({b: self._measure(compiled, self._views(sz), measure) for b, sz in probed})
        for b, _ in sizes:
            self.choices[(phase.value, b)] = report[b]["choice"] if b in report else report[probed[-1][0]]["choice"]
        unprobed = [sz for b, sz in sizes if b not in report and self.choices[(phase.value, b)] == "compiled"]
        if unprobed:  # a second size makes the token dimension dynamic: that graph, which serves
            compiled(self._views(unprobed[0]))  # every larger bucket, compiles now, not mid-serving
        fused_rule = (f"; the fused layers' buckets of up to {sure} rows stay eager, the first above them and "
                      f"the largest are measured" if sure else "")
        self.report[phase.value] = {
            "choice": self._picked(phase), "buckets": report, "choices": self._role_choices(phase),
            "rule": (f"measured: decode at 1, 2 and its largest bucket (those between take the largest's "
                     f"choice{fused_rule}); prefill at its smallest bucket, for all; compiled where >= "
                     f"{MIN_GAIN:.0%} faster than eager" if measure
                     else f"compile={mode!r}{' on cuda' if cuda else ''}: compiled everywhere")}

    def _adopt(self, phase: Phase, recorded: dict) -> None:
        """One role's choices from the record. The buckets chosen compiled are made ready now, not
        mid-serving: saved steps bound to each bucket (loaded, or compiled where none serves); a step
        that compiles as it is called (traced, or the prefill around its saved layer) called at its
        first two such buckets (the second makes the token dimension dynamic, the graph every larger
        bucket shares; the saved layer's larger buckets bind at their first call, a guard check)."""
        chosen, step = recorded["choices"], self.compiled_steps[phase]
        compiled = [sizes for b, sizes in phase_buckets(self.shapes, phase) if chosen[b] == "compiled"]
        for b, _ in phase_buckets(self.shapes, phase):
            self.choices[(phase.value, b)] = chosen[b]
        for sizes in compiled if isinstance(step, SavedSteps) else compiled[:2]:
            (step.prepare if isinstance(step, SavedSteps) else step)(self._views(sizes))
        self.report[phase.value] = {**recorded, "choice": self._picked(phase)}

    def prefill_at_own_rows(self, views: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The compiled prefill step over views of fewer token rows than their bucket, where a saved form
        of its layer serves them as they are: its graph is dynamic in the tokens, so a bucket's padding
        rows would be arithmetic for nothing (a 1-token prompt padded to a 32-token bucket). None where
        no saved form serves these rows (it is not compiled now, mid-serving: the caller replays the
        bucket) or where the layer is traced rather than saved (a guard that fails would recompile).
        Counted in report["prefill"]["own_rows"]: runs, and the row counts no saved form served."""
        layer = self.saved_steps.get(Phase.PREFILL)
        if layer is None:
            return None
        rows = views["input_ids"].shape[0]
        counts = self.report[Phase.PREFILL.value].setdefault("own_rows", {"runs": 0, "unserved": []})
        if rows in counts["unserved"]:
            return None
        try:
            with layer.saved_only():
                hidden = self.compiled_steps[Phase.PREFILL](views)
        except saved_steps.Unserved:
            counts["unserved"].append(rows)
            return None
        counts["runs"] += 1
        return hidden

    def compiles_one_row(self, mode: str) -> bool:
        """Whether a step this layout compiles multiplies one row (where forms.choose_gemv's one-row form
        applies): compile="on" compiles the 1-row decode; "auto" on the CPU not where the fused layers
        run it (FUSED_ROWS) nor on a tensor-parallel layout (TP_ON_CPU). The LM head is measured
        compiled against eager on its own (_prepare_head)."""
        return mode == "on" or (mode == "auto" and self.state.shard.tp_size == 1 and not self.fused_rows())

    def fused_rows(self) -> int:
        """Up to how many rows this rank's eager decode runs the fused layers (kernels/cpu/fused_layer.py;
        0: it does not)."""
        w = self.state.weights
        if not w.layers:
            return 0
        dtype = w.layers[0].qkv_proj.dtype
        fused = fused_layer.report(dtype, self.state.shard.tp_size, w.plain)["reason"] is None
        return fused_layer.max_rows(dtype) if fused else 0

    def _picked(self, phase: Phase) -> str:
        picked = {self.choices[(phase.value, b)] for b, _ in phase_buckets(self.shapes, phase)}
        return picked.pop() if len(picked) == 1 else "per bucket"

    def _role_choices(self, phase: Phase) -> dict[int, str]:
        return {b: self.choices[(phase.value, b)] for b, _ in phase_buckets(self.shapes, phase)}

    def _prepare_head(self, measure: bool, recorded: dict | None) -> None:
        """The LM head for a decode that samples up to GEMV_ROWS rows (CPU): inductor's one pass over
        the head where it is measured faster (or compile="on"; or so recorded), else the eager product.
        Where one-row products were measured faster eager (forms.choose_gemv) a compiled head is
        the same call: none."""
        if quant.weight_format(self.state.weights.lm_head) is not None:
            self.report["head"] = {"choice": "eager", "reason": "the head is in a GGUF block format (its kernel)"}
            return
        if cpu_linear.form(GEMV_ROWS, self.state.weights.lm_head.dtype, traced=True) != "reduction":
            self.report["head"] = {"choice": "eager",
                                           "reason": "one-row products run eager (measured)"}
            return
        compiled = self._compiled_head()
        rows = {"hidden_in": self.buffers.tensors["hidden_in"][:GEMV_ROWS]}
        if recorded is not None:
            report = recorded
            if report["choice"] == "compiled":
                compiled(rows)
        else:
            report = self._measure(compiled, rows, measure,
                                   lambda v: _head_logits(self.state, v))
        self.head = ((lambda head, hidden: compiled({"hidden_in": hidden}))
                     if report["choice"] == "compiled" else None)
        self.report["head"] = report

    def _compiled_head(self):
        """The LM head's logits of views["hidden_in"], compiled: saved beside the decode step's graphs
        where those are (_compiled_steps), else traced."""
        decode = self.compiled_steps[Phase.DECODE]
        if isinstance(decode, SavedSteps):
            return SavedSteps(_head_logits, decode.owner, decode.dir.parent / "head")
        compiled = compile_region(compute_logits)
        return lambda v: compiled(self.state.weights.lm_head, v["hidden_in"], final_softcap(self.state.cfg))

    def _measure(self, compiled, views: dict[str, torch.Tensor], measure: bool, eager=None) -> dict:
        """One bucket: the first compiled call (it compiles when no earlier bucket had these guards),
        then, when measuring, the best of a few calls of each, compiled and eager timed in turn (timed
        one after the other, a cold boot's compile work can make the faster step time as the slower,
        and the boot then serves the slower); compiled where it is at least MIN_GAIN faster."""
        t0 = time.perf_counter()
        compiled(views)
        first_ms = (time.perf_counter() - t0) * 1e3
        if not measure:
            return {"choice": "compiled", "first_call_ms": first_ms, "compiled_ms": None, "eager_ms": None}
        ms = time_alternating({"compiled": compiled, "eager": eager or self.step_fn}, views)
        compiled_ms, eager_ms = ms["compiled"], ms["eager"]
        return {"choice": "compiled" if compiled_ms <= (1 - MIN_GAIN) * eager_ms else "eager",
                "first_call_ms": first_ms, "compiled_ms": compiled_ms, "eager_ms": eager_ms}

    def choose_by_replay(self, pool, stream) -> None:
        """compile="auto" on CUDA: each bucket's compiled and uncompiled step captured as CUDA graphs and
        replayed (uncaptured, the eager step would pay a launch per kernel: no fair comparison); the
        faster is kept and the report gives both times. The two graphs are dropped (their memory goes
        back to the pool) before the kept step's variants are captured."""
        for phase in Phase:
            report = self.report[phase.value]
            for bucket, sizes in phase_buckets(self.shapes, phase):
                if self.choices.get((phase.value, bucket)) != "compiled":
                    continue
                key = StepKey(self.layout, phase.value, bucket)
                ms = {backend: time_replays(capture_cuda(key, fn, self.buffers, bucket_rows(sizes), pool, stream))
                      for backend, fn in (("compiled", self.compiled_steps[phase]), ("eager", self.step_fn))}
                choice = "compiled" if ms["compiled"] <= ms["eager"] else "eager"
                self.choices[(phase.value, bucket)] = choice
                buckets = report.setdefault("buckets", {})
                buckets[bucket] = {**buckets.get(bucket, {}), "choice": choice, "compiled_ms": ms["compiled"],
                                   "eager_ms": ms["eager"]}
            report["choice"], report["choices"] = self._picked(phase), self._role_choices(phase)
            report["rule"] = ("measured on CUDA: every bucket's compiled and uncompiled step as CUDA graphs, "
                              "replayed (ms per replay); the faster kept")


def _head_logits(state: StepState, views: dict[str, torch.Tensor]) -> torch.Tensor:
    """The LM head's logits of views["hidden_in"] (the step a compiled head runs)."""
    return compute_logits(state.weights.lm_head, views["hidden_in"], final_softcap(state.cfg))
