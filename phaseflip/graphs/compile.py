"""Compiling a step's repeated unit with inductor, and measuring whether it pays (CPU).

Owns: `import_compiler` (dynamo's and inductor's imports started in a thread, for a boot to overlap
with its first phases), `vec_isas` (inductor's probe of the CPU's vector ISAs, recorded and trusted),
`compile_region` (torch.compile with a dynamic token dimension, applied to one
decoder layer so that identical layers and every bucket share one compiled graph), `compile_whole_step` (the same for a
CPU decode step as a whole, its wrapper in C++) and `DirectStep` (such a step bound to a bucket's
views and replayed without dynamo), `use_cache_dir` and `cache_dirs` (inductor's and
Triton's on-disk caches under a directory the caller names, so a second boot loads what the first
compiled), `time_alternating` (the best wall time of each of a few steps timed in turn, for the
eager-vs-compiled choice on the CPU), `time_step` (a median) and `time_replays` (a captured step's
replay time: CUDA events on a CUDA graph, for the same choice on CUDA, where only graph against graph
is a fair comparison)."""
from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

import torch


def import_compiler(device: str, cache_root: str | None) -> threading.Thread:
    """Import dynamo and inductor's compiler (what loading or compiling a step imports first: about 2 s
    on the CPU) in a thread, started now; the caller joins it before it compiles. The imports run
    Python while the caller's first phases (packing weights, filling the arena) run torch ops, which
    leave the interpreter to it. On the CPU the thread then points inductor at the boot's cache
    (use_cache_dir) and settles which vector ISAs inductor generates code for (vec_isas: a recorded
    probe, or the probe itself), which loading a saved step would otherwise do on the caller's time."""
    def imports():
        import torch._dynamo  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
        if device == "cpu":
            if cache_root is not None:
                use_cache_dir(cache_root)
            vec_isas(cache_root)
    thread = threading.Thread(target=imports, name="phaseflip-import-compiler", daemon=True)
    thread.start()
    return thread


def vec_isas(cache_root: str | None) -> list[str]:
    """The vector ISAs inductor generates CPU code for here, probed once for the process: inductor's
    probe builds a test per ISA the CPU names and loads each in a child Python (~1 s with the builds
    cached). Where an earlier probe with this key (torch, the compiler, the CPU's flags) is recorded
    under cache_root, inductor is told to trust the CPU's flags instead (its config.cpp.vec_isa_ok)
    and the list that gives is kept only if it is the recorded one: else the probe runs after all."""
    from torch._inductor import config, cpu_vec_isa
    from phaseflip.cache import cpu_flags, key_digest, read_record, write_record

    def probed() -> list[str]:
        return [type(isa).__name__ for isa in cpu_vec_isa.valid_vec_isa_list()]
    if cache_root is None or getattr(config.cpp, "vec_isa_ok", False) is not None:   # none kept; the user's setting
        return probed()
    key = {"torch": torch.__version__, "cxx": os.environ.get("CXX"), "cpu": cpu_flags()}
    path = Path(cache_root) / "vec_isa" / f"{key_digest(key)}.json"
    record = read_record(path, key)
    if record is not None:
        config.cpp.vec_isa_ok = True
        if probed() == record["isas"]:
            return record["isas"]
        config.cpp.vec_isa_ok = None
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
    isas = probed()
    write_record(path, key, {"isas": isas}, keep=8)
    return isas


def compile_region(fn):
    """fn compiled once for every call with the same guards: tensors that differ only in contents or
    address (each layer's weights) share one graph. Automatic dynamic shapes: a dimension becomes
    symbolic once a second size is seen (the token count; 0/1 still specialise), while the weights'
    dimensions stay static (dynamic=True makes them symbolic too, and inductor's one-row reduction over
    a symbolic weight runs ~70x slower)."""
    return torch.compile(fn, dynamic=None)


def compile_whole_step(fn):
    """compile_region, with inductor's wrapper (the code that calls the graph's kernels one after the
    other) in C++: a CPU decode step makes hundreds of kernel and op calls (SmolLM2 at batch 1: ~240),
    and with the C++ wrapper it runs a few percent faster than with the Python one. The wrapper is built
    apart from the kernels where this torch can: that about halves the step's first compile (warm boots
    are alike either way).
    Its graphs report their calls while a DirectStep binds (`_reporting_inductor`)."""
    import torch._inductor.config as inductor_config   # at the call: no import-time work
    options = {"cpp_wrapper": True}
    if hasattr(inductor_config, "cpp_wrapper_build_separate"):   # where this torch has the option
        options["cpp_wrapper_build_separate"] = True
    return torch.compile(fn, dynamic=None, backend=_reporting_inductor(options))


_calls: list | None = None   # while a DirectStep binds: each compiled graph's call, as (graph, args, out)


def _reporting_inductor(options: dict):
    """inductor with `options` as its config patches (as torch.compile(options=...) gives them), each
    graph it compiles reporting its calls to `_calls` while that is set (DirectStep)."""
    def backend(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx
        graph = compile_fx(gm, example_inputs, config_patches=options)

        def run(*args):
            out = graph(*args)
            if _calls is not None:
                _calls.append((graph, args, out))
            return out
        return run
    return backend


class DirectStep:
    """A compile_whole_step step for one bucket's views, replayed without dynamo once bound: the CPU's
    counterpart of a CUDA graph over static buffers. Its first call goes through dynamo, twice, and
    records what dynamo handed the compiled graph; where both calls ran exactly one graph with the same
    inputs (the same tensor objects: the bucket's views, the weights' arena views, the KV cache) and
    returned one of its outputs, later calls with the same views call that graph directly on those
    inputs: no frame evaluation, no guards (~200 weight tensors checked a call), no Python gathering
    the inputs. Any other call, or a step that does not bind, goes through dynamo. A bound batch-1
    decode step runs a few percent faster than through dynamo."""

    def __init__(self, compiled):
        self.compiled = compiled
        self.views: dict | None = None
        self.direct: tuple | None = None   # (graph, its inputs, which output the step returns)

    def __call__(self, views: dict[str, torch.Tensor]):
        if self.direct is not None and views is self.views:
            graph, args, index = self.direct
            return graph(*args)[index]
        if self.views is not None:
            return self.compiled(views)
        first, second = self._recorded(views), self._recorded(views)
        self.views, self.direct = views, _binding(first, second)
        return second[1]

    def _recorded(self, views):
        global _calls
        _calls = []
        try:
            return _calls, self.compiled(views)
        finally:
            _calls = None


def _binding(first: tuple, second: tuple) -> tuple | None:
    """(graph, inputs, output index) where two recorded calls of a step ran one graph on the same inputs
    and the step returned one of its outputs, else None."""
    (calls_a, _), (calls_b, ret) = first, second
    if len(calls_a) != 1 or len(calls_b) != 1:
        return None
    (graph, args, _), (graph_b, args_b, out) = calls_a[0], calls_b[0]
    same = graph is graph_b and len(args) == len(args_b) and all(
        a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(args, args_b))
    index = next((i for i, o in enumerate(out) if o is ret), None)
    return (graph, args_b, index) if same and index is not None else None


def cache_dirs(root: str) -> dict[str, str]:
    """Where inductor's and Triton's caches go for a compile cache at root: below it, unless the user
    named a directory. Importing torch._dynamo (torch 2.13) writes inductor's default dir into
    TORCHINDUCTOR_CACHE_DIR, so that value counts as unset: taken as the user's, it would keep every
    boot's compiled code in the temp dir."""
    wanted = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor"),
              "TRITON_CACHE_DIR": os.path.join(root, "triton")}
    return {name: path if os.environ.get(name) in (None, _torch_default_dir(name)) else os.environ[name]
            for name, path in wanted.items()}


def use_cache_dir(root: str) -> dict[str, str]:
    """Point inductor's and Triton's caches at cache_dirs(root); returns where they are. Boot calls
    this before anything compiles (never at import)."""
    paths = cache_dirs(root)
    os.environ.update(paths)
    limit = max(64, getattr(torch._dynamo.config, "cache_size_limit", 8))
    torch._dynamo.config.cache_size_limit = limit  # guard sets of one layer fn: per layout x role
    return paths


def _torch_default_dir(name: str) -> str | None:
    """The directory torch itself puts in env var `name` when it finds it unset (None: it sets none)."""
    if name != "TORCHINDUCTOR_CACHE_DIR":
        return None
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:   # an older layout: torch never writes the variable there
        return None
    return os.path.abspath(default_cache_dir())


def time_step(fn, views: dict[str, torch.Tensor], repeats: int = 3) -> float:
    """Median ms of fn(views) after one untimed run (which also triggers any compilation)."""
    fn(views)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(views)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_alternating(fns: dict, views: dict[str, torch.Tensor], rounds: int = 5) -> dict[str, float]:
    """name -> best ms of fns[name](views) over `rounds` rounds that call each fn once in turn, after
    one untimed call of each (which also triggers any compilation). In turn, not one fn's calls and
    then the other's: a burst of other work on a busy machine (at a cold boot, inductor's compile
    workers) then slows both, not only whichever was being timed; its best, not its median: such
    bursts only ever add time."""
    for fn in fns.values():
        fn(views)
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn(views)
            best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
    return best


def time_replays(step, repeats: int = 5) -> float:
    """Mean ms of a captured step's replays after one untimed replay: CUDA events around the replays of
    a CUDA graph, the wall clock for any other backend."""
    if step.backend != "cuda":
        return time_step(lambda _: step.replay(), {}, repeats)
    step.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        step.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats
