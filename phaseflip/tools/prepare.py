"""What `make setup` prepares once per machine, before any boot: the embedded default model converted,
the CPU kernels built for this CPU, inductor's probe of which vector ISAs build here, and inductor's
precompiled headers (built by the first C++ compile of an installation, ~5 s each, kept by inductor in
its own global directory): all at once (the kernel build and inductor's run a compiler, the conversion
runs Python), so that a first boot finds them done instead of doing them on its own time.

Owns: `main` (`python -m phaseflip.tools.prepare`).
"""
from __future__ import annotations

import logging
import threading
import time


def main() -> None:
    from phaseflip.cache import cache_dir
    from phaseflip.engine.checkpoint.default_model import ensure_default_model
    from phaseflip.graphs.compile import import_compiler, vec_isas
    from phaseflip.kernels.cpu import library

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.perf_counter()
    root = str(cache_dir() / "compile")
    # the probe runs in import_compiler's own thread, as at a rank's boot: the same cache, the same work
    probe = import_compiler("cpu", root)
    kernels = threading.Thread(target=library.few_rows_op, name="prepare-kernels")
    kernels.start()
    headers = threading.Thread(target=lambda: (probe.join(), _first_compiles()), name="prepare-headers")
    headers.start()
    try:
        print("default model:", ensure_default_model())
    finally:   # a failed conversion raises after the threads end (a compile at shutdown fails by itself)
        kernels.join()
        headers.join()
    print("CPU kernels:", library.kernel_report())
    print("inductor's vector ISAs:", ", ".join(vec_isas(root)) or "none builds")   # recorded by the probe
    print(f"prepared in {time.perf_counter() - t0:.1f} s")


def _first_compiles() -> None:
    """A small function compiled as a boot compiles its steps (C++ kernels; a whole step's C++ wrapper):
    what inductor's first compiles build for any model, its precompiled headers, is then built."""
    import torch
    from phaseflip.graphs.saved_steps import wrapper_options

    x = torch.randn(4, 64)
    try:
        for options in ({}, wrapper_options()):
            torch.compile(lambda t: (t * t).sum(-1).softmax(-1), dynamic=None, options=options)(x)
    except Exception as e:   # torch raises many kinds here (no compiler, a broken toolchain...)
        print(f"inductor could not compile a small function here ({type(e).__name__}: {str(e).strip()[:200]}); "
              "compile='off' boots without it")


if __name__ == "__main__":
    main()
