"""Compiled CPU steps kept on disk: a boot loads the graphs an earlier boot compiled, with no dynamo
trace and no inductor run.

Owns: `SavedSteps`, a step `fn(owner, views)` (a whole decode step, or the LM head) called as
`step(views)`, and `SavedLayer`, one decoder layer called as forward calls its layer_fn; each compiled,
its compiled forms kept under one directory: each a
`torch.compile(fullgraph=True).aot_compile` artifact (its guards, its bytecode and inductor's code, C++
wrapper included) saved with `save_compiled_function`. A bucket's views take the first saved artifact
whose guards pass (loading one skips dynamo's trace, the larger part of a warm torch.compile:
docs/performance.md); where none does, the step is compiled at those views, their row dimension marked
dynamic (dynamo specialises it where the step branches on it, as automatic dynamic shapes would), and
saved beside the others. Once bound, a bucket's calls skip the guards (its views keep their shapes; the
owner's attributes do not change after boot): no frame evaluation, no guards. A step that cannot be
saved (a graph break, a value dynamo cannot pickle) is reported and traced by torch.compile at every
boot instead. Within `saved_only()` a shape no saved form serves raises `Unserved` instead of
compiling (a caller trying a size its boot did not bind, which must not compile mid-serving).
`available()` says whether this torch has the API (graphs/compile.py's
compile_whole_step and DirectStep serve where it does not). The directory's name is the caller's key:
whatever the graphs depend on (the model, the shard, phaseflip's own source, torch) must be in it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger("phaseflip")


def available() -> bool:
    """Whether this torch saves and loads compiled functions (torch.compiler.load_compiled_function)."""
    return hasattr(torch.compiler, "load_compiled_function")


def wrapper_options() -> dict:
    """inductor's options for a whole CPU step: its wrapper (the code calling the graph's kernels one
    after the other, hundreds per decode step) in C++, built apart from the kernels where this torch can."""
    import torch._inductor.config as inductor_config   # at the call: no import-time work
    options = {"cpp_wrapper": True}
    if hasattr(inductor_config, "cpp_wrapper_build_separate"):
        options["cpp_wrapper_build_separate"] = True
    return options


class Unserved(LookupError):
    """No saved compiled form serves these shapes, and compiling was not allowed (saved_only)."""


class SavedSteps:
    """fn(owner, views), compiled: the saved compiled forms of fn under `directory`, one bound per shape
    of views (the first call at a shape finds or compiles it)."""

    dynamic_sources = ""   # dynamo's names of int arguments compiled as symbols (SavedLayer's layer index)

    def __init__(self, fn: Callable, owner, directory: Path, options: dict | None = None):
        self.fn, self.owner, self.dir, self.options = fn, owner, Path(directory), options or {}
        self._loaded: list[tuple[str, object]] | None = None   # (file name, artifact)
        self._bound: dict[tuple, Callable] = {}                # the arguments' signature -> fn, unguarded
        self._fallback = None                                  # torch.compile's fn where saving failed
        self._compiles = True                                  # False within saved_only()
        self.report = {"dir": str(self.dir), "loaded": [], "compiled": [], "load_ms": 0.0, "compile_ms": 0.0}

    def __call__(self, views: dict[str, torch.Tensor]):
        run = self._bound.get(_signature(views)) or self.prepare(views)
        return run(self.owner, views)

    def prepare(self, views: dict[str, torch.Tensor]) -> Callable:
        """Bind views' shapes to a saved compiled form (compiled and saved where none serves), without
        running the step; returns the bound step (fn(owner, views), unguarded)."""
        return self._bind(_signature(views), (self.owner, views))

    @contextlib.contextmanager
    def saved_only(self):
        """Within: shapes no saved form serves raise Unserved instead of being compiled (or traced)."""
        self._compiles = False
        try:
            yield
        finally:
            self._compiles = True

    def _bind(self, signature: tuple, args: tuple) -> Callable:
        if signature not in self._bound:
            artifact = None if "not_saved" in self.report else self._find(args)
            if artifact is None and not self._compiles:
                raise Unserved(f"no saved form of {self.fn.__name__} serves {_rows(args)} rows")
            if artifact is None and "not_saved" not in self.report:
                artifact = self._compile(args)
            self._bound[signature] = self._traced if artifact is None else artifact.fn   # unguarded
        return self._bound[signature]

    def _traced(self, *args):
        """Where fn cannot be saved: torch.compile's own path, traced at every boot."""
        if self._fallback is None:
            self._fallback = torch.compile(self.fn, dynamic=None, options=self.options)
        return self._fallback(*args)

    def _artifacts(self) -> list[tuple[str, object]]:
        if self._loaded is None:
            t0 = time.perf_counter()
            self._loaded = []
            for path in sorted(self.dir.glob("*.pt")) if self.dir.is_dir() else ():
                try:
                    with open(path, "rb") as fh:
                        self._loaded.append((path.name, torch.compiler.load_compiled_function(fh)))
                except Exception as e:   # a file of another torch, or cut short: compiled again if needed
                    log.warning("compiled step %s not loaded (%s: %s)", path, type(e).__name__, str(e)[:200])
            self.report["load_ms"] += (time.perf_counter() - t0) * 1e3
        return self._loaded

    def _find(self, args: tuple):
        for name, artifact in self._artifacts():
            if artifact.guard_check(*args):
                if name not in self.report["loaded"]:
                    self.report["loaded"].append(name)
                return artifact
        return None

    def _compile(self, args: tuple):
        """fn compiled at args and saved; None where it cannot be (a graph break, a value dynamo cannot
        save): the reason is reported and fn is traced at every boot instead."""
        t0 = time.perf_counter()
        rows = _rows(args)
        name = f"{len(self._artifacts()):03d}-{os.getpid()}.pt"
        log.info("compiling %s at %d rows (saved for the next boots in %s)", self.fn.__name__, rows, self.dir)
        compiled = torch.compile(self.fn, fullgraph=True, dynamic=None, options=self.options)
        try:
            symbols = (torch.compiler.config.patch(dynamic_sources=self.dynamic_sources) if self.dynamic_sources
                       else contextlib.nullcontext())
            with symbols:
                artifact = compiled.aot_compile((tuple(_marked(a) for a in args), {}))
            self.dir.mkdir(parents=True, exist_ok=True)
            artifact.save_compiled_function(str(self.dir / name))   # written whole, then renamed
        except Exception as e:   # torch raises many kinds here (Unsupported, TypeError from pickling, ...)
            self.report["not_saved"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
            log.warning("compiled step not saved, traced at every boot instead (%s)", self.report["not_saved"])
            return None
        self._loaded.append((name, artifact))
        self.report["compiled"].append(name)
        self.report["compile_ms"] += (time.perf_counter() - t0) * 1e3
        log.info("compiled %s at %d rows in %.1f s", self.fn.__name__, rows, time.perf_counter() - t0)
        return artifact


class SavedLayer(SavedSteps):
    """One decoder layer, called as the step calls its layer_fn (lw, cfg, shard, delta, residual, meta,
    kv, layer, cos_sin, comm), compiled and saved as SavedSteps does: its layer index compiled as a
    symbol (one graph serves every layer; a Python int would be specialised, a graph per layer), the
    first layer (no delta yet) given a zero delta, so that the same graph serves it (a cold boot
    compiles one graph, not two; adding zeros changes no value). Bound per shape of its tensors and of
    its weights (LayerWeights.signature): a bound form serves every layer stored alike, unguarded."""

    dynamic_sources = "L['layer']"

    def __init__(self, fn: Callable, directory: Path, options: dict | None = None):
        super().__init__(fn, None, directory, options)

    def __call__(self, lw, cfg, shard, delta, residual, meta, kv, layer, cos_sin, comm):
        if delta is None:
            delta = torch.zeros_like(residual)
        args = (lw, cfg, shard, delta, residual, meta, kv, layer, cos_sin, comm)
        weights = getattr(lw, "signature", None) or _signature({"lw": lw})   # LayerWeights, or one tensor
        signature = (weights, _signature({"residual": residual, "cos_sin": cos_sin, **meta}))
        run = self._bound.get(signature) or self._bind(signature, args)
        return run(*args)


def _marked(value):
    """A value as aot_compile is handed it: tensors (in dicts too) as new tensors of the same kind, their
    rows marked dynamic (the caller's stay unmarked: a marked tensor fails the saved guards later). A
    view stays a view of its base and a tensor that owns its storage becomes a copy that owns its own:
    the saved guards read a view's base (`_base`), which a tensor that is no view does not have."""
    if isinstance(value, dict):
        return {k: _marked(v) for k, v in value.items()}
    if not isinstance(value, torch.Tensor):
        return value
    twin = value[...] if value._base is not None else value.clone()
    if twin.dim() > 0 and twin.shape[0] > 1:
        torch._dynamo.maybe_mark_dynamic(twin, 0)
    return twin


def _rows(args: tuple) -> int:
    """The first tensor's rows among args (dicts searched too), for the log."""
    for a in args:
        for v in (a.values() if isinstance(a, dict) else (a,)):
            if isinstance(v, torch.Tensor):
                return v.shape[0] if v.dim() else 1
    return 0


def _signature(views: dict[str, torch.Tensor]) -> tuple:
    """What a bound artifact depends on in views: each tensor's name, shape, stride and dtype."""
    return tuple((name, tuple(v.shape), v.stride(), v.dtype) for name, v in views.items())
