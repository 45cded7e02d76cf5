"""`timed(into, name)`: a context manager that writes the block's wall time in ms into a dict.

Owns: the one way boot phases are timed, on the controller and on every rank."""
from __future__ import annotations

import time
from contextlib import contextmanager


@contextmanager
def timed(into: dict[str, float], name: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        into[name] = (time.perf_counter() - t0) * 1e3
