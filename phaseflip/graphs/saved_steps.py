"""Compiled CPU steps kept on disk: a boot loads the graphs an earlier boot compiled, with no dynamo
trace and no inductor run.

Owns: `SavedSteps`, a step `fn(owner, views)` (a whole decode step, or the LM head) called as
`step(views)`, compiled, its compiled forms kept under one directory: each a
`torch.compile(fullgraph=True).aot_compile` artifact (its guards, its bytecode and inductor's code, C++
wrapper included) saved with `save_compiled_function`. A bucket's views take the first saved artifact
whose guards pass (loading one skips dynamo's trace, the larger part of a warm torch.compile:
docs/performance.md); where none does, the step is compiled at those views, their row dimension marked
dynamic (dynamo specialises it where the step branches on it, as automatic dynamic shapes would), and
saved beside the others. Once bound, a bucket's calls skip the guards (its views keep their shapes; the
owner's attributes do not change after boot): no frame evaluation, no guards. A step that cannot be
saved (a graph break, a value dynamo cannot pickle) is reported and traced by torch.compile at every
boot instead. `available()` says whether this torch has the API (graphs/compile.py's
compile_whole_step and DirectStep serve where it does not). The directory's name is the caller's key:
whatever the graphs depend on (the model, the shard, phaseflip's own source, torch) must be in it.
"""
from __future__ import annotations

import functools
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


class SavedSteps:
    """fn(owner, views), compiled: the saved compiled forms of fn under `directory`, one bound per shape
    of views (the first call at a shape finds or compiles it)."""

    def __init__(self, fn: Callable, owner, directory: Path, options: dict | None = None):
        self.fn, self.owner, self.dir, self.options = fn, owner, Path(directory), options or {}
        self._loaded: list[tuple[str, object]] | None = None   # (file name, artifact)
        self._bound: dict[tuple, Callable] = {}                # views' signature -> the step, unguarded
        self._fallback = None                                  # torch.compile's step where saving failed
        self.report = {"dir": str(self.dir), "loaded": [], "compiled": [], "load_ms": 0.0, "compile_ms": 0.0}

    def __call__(self, views: dict[str, torch.Tensor]):
        run = self._bound.get(_signature(views)) or self.prepare(views)
        return run(self.owner, views)

    def prepare(self, views: dict[str, torch.Tensor]) -> Callable:
        """Bind views' shapes to a saved compiled form (compiled and saved where none serves), without
        running the step; returns the bound step (fn(owner, views), unguarded)."""
        signature = _signature(views)
        if signature not in self._bound:
            artifact = None if "not_saved" in self.report else self._find(views) or self._compile(views)
            self._bound[signature] = self._traced if artifact is None else artifact.fn   # unguarded
        return self._bound[signature]

    def _traced(self, owner, views):
        """Where this step cannot be saved: torch.compile's own path, traced at every boot."""
        if self._fallback is None:
            self._fallback = torch.compile(functools.partial(self.fn, owner), dynamic=None, options=self.options)
        return self._fallback(views)

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

    def _find(self, views):
        for name, artifact in self._artifacts():
            if artifact.guard_check(self.owner, views):
                if name not in self.report["loaded"]:
                    self.report["loaded"].append(name)
                return artifact
        return None

    def _compile(self, views):
        """fn compiled at views and saved; None where it cannot be (a graph break, a value dynamo cannot
        save): the reason is reported and the step is traced at every boot instead."""
        t0 = time.perf_counter()
        marked = {}   # views of the same tensors, their rows marked dynamic (a marked tensor fails the
        for name, v in views.items():   # saved guards later: the caller's stay unmarked)
            marked[name] = v[...]
            if v.dim() > 0 and v.shape[0] > 1:
                torch._dynamo.maybe_mark_dynamic(marked[name], 0)
        compiled = torch.compile(self.fn, fullgraph=True, dynamic=None, options=self.options)
        name = f"{len(self._artifacts()):03d}-{os.getpid()}.pt"
        rows = next(iter(views.values())).shape[0]
        log.info("compiling %s at %d rows (saved for the next boots in %s)", self.fn.__name__, rows, self.dir)
        try:
            artifact = compiled.aot_compile(((self.owner, marked), {}))
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


def _signature(views: dict[str, torch.Tensor]) -> tuple:
    """What a bound artifact depends on in views: each tensor's name, shape, stride and dtype."""
    return tuple((name, tuple(v.shape), v.stride(), v.dtype) for name, v in views.items())
