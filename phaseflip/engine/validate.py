"""The few checks every validated config and input of the engine is built from (no torch).

Owns: `require` (raise ValueError with the caller's message, which names the bad value and what is
allowed), `is_number` (a finite int or float, never a bool) and `count` (an int >= 1, the message
naming where it came from).
"""
from __future__ import annotations

import math


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def count(x, path: str) -> int:
    """x itself when it is an integer >= 1; else a ValueError naming path and x."""
    require(isinstance(x, int) and not isinstance(x, bool) and x >= 1, f"{path} must be an integer >= 1, got {x!r}")
    return x
