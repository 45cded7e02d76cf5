"""What `make setup` prepares once per machine, before any boot: the embedded default model converted,
the CPU kernels built for this CPU, and inductor's probe of which vector ISAs build here, each kept in
the phaseflip cache, all three at once (the kernel build and the probe run a compiler, the conversion
runs Python), so that a first boot finds them there instead of doing them on its own time.

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
    # the probe runs in import_compiler's own thread, as at a rank's boot: the same cache, the same work
    root = str(cache_dir() / "compile")
    probe = import_compiler("cpu", root)
    kernels = threading.Thread(target=library.few_rows_op, name="prepare-kernels")
    kernels.start()
    print("default model:", ensure_default_model())
    kernels.join()
    probe.join()
    print("CPU kernels:", library.kernel_report())
    print("inductor's vector ISAs:", ", ".join(vec_isas(root)) or "none builds")   # recorded by the probe
    print(f"prepared in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
