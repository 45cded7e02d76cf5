"""Which cells of a parity matrix the default suite runs, and which only `make test-slow` runs.

Owns: `cells`, the parameters of a test over a matrix (a family x a layout, a family x a scheduling
variant) in which the cells that exercise a code path no default cell exercises run by default, and
the others (the same path again on another family: a rope table, Mistral's Llama layout) are marked
slow with the reason, so `make test` keeps to its minutes on 2 cores and `make test-slow` runs them all.

Example:
    @pytest.mark.parametrize("kind", cells(KINDS, default=("llama", "gemma2"), why="..."))
"""
from __future__ import annotations

from typing import Callable, Iterable

import pytest


def cells(values: Iterable, *, default: Callable[..., bool] | Iterable, why: str) -> list:
    """`values` as pytest parameters (tuples for several arguments); those `default` keeps (a set of
    values, or a predicate over a value's arguments) run in the default suite, the rest are slow with
    `why` as the skip's reason."""
    keep = _keeper(default)
    params = []
    for v in values:
        args = v if isinstance(v, tuple) else (v,)
        marks = () if keep(*args) else (pytest.mark.slow(reason=why),)
        params.append(pytest.param(*args, id="-".join(map(str, args)), marks=marks))
    return params


def _keeper(default) -> Callable[..., bool]:
    if callable(default):
        return default
    chosen = frozenset(default)
    return lambda *args: (args[0] if len(args) == 1 else args) in chosen
