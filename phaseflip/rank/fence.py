"""The restore-never-rebuild fence: after boot, the build entry points raise (a test hook).

Owns: `install_rebuild_fence`, which replaces the arena allocation, the weight packing, the KV region
allocation and the step capture entry points — wherever they are looked up — with functions that raise
RebuildError. A flip that only copies never notices; one that rebuilds fails loudly. The refill copy is
deliberately NOT fenced: it is the work a flip must do, and a fence that forbids it proves nothing.
"""
from __future__ import annotations

import importlib


class RebuildError(RuntimeError):
    """A build entry point ran after boot: a flip (or a step) rebuilt instead of restoring."""


# (module, attribute) for every place a build entry point is looked up at call time.
ENTRY_POINTS = (
    ("phaseflip.rank.arena", "allocate_arena"),
    ("phaseflip.rank.arena", "pack_image"),
    ("phaseflip.rank.runtime", "pack_image"),
    ("phaseflip.rank.runtime", "allocate_arena"),
    ("phaseflip.rank.kvcache", "zeros"),
    ("phaseflip.graphs.capture", "capture_eager"),
    ("phaseflip.graphs.capture", "capture_cuda"),
    ("phaseflip.rank.runner", "capture_eager"),
    ("phaseflip.rank.runner", "capture_cuda"),
    ("phaseflip.rank.runner", "compile_region"),
)


def install_rebuild_fence() -> list[str]:
    """Fence every entry point in this process; returns their names."""
    fenced = []
    for module_name, attr in ENTRY_POINTS:
        module = importlib.import_module(module_name)

        def raiser(*args, _name=f"{module_name}.{attr}", **kwargs):
            raise RebuildError(f"{_name} was called after boot: restore, never rebuild")
        setattr(module, attr, raiser)
        fenced.append(f"{module_name}.{attr}")
    return fenced
