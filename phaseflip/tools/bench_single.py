"""The single-stream figures of `phaseflip bench`, timed the same way for the engine and for HF.

Owns `single_stream`: time to first token and the per-token decode cost at batch 1, from runs of one
token and of n tokens alternated (a slow spell of the machine falls on both lengths), the median of each
length. The per-token figures are the difference of the two medians; where the long runs' median is not
above the short runs' (the machine's noise swamped n - 1 tokens) they are None, with the reason.
"""
from __future__ import annotations

import statistics
from typing import Callable


def single_stream(timed: Callable[[int], float], n: int, repeats: int = 3) -> dict:
    """timed(k): the seconds one request of k output tokens takes; n >= 2."""
    short, long = [], []
    for _ in range(repeats):
        short.append(timed(1))
        long.append(timed(n))
    ttft, full = statistics.median(short), statistics.median(long)
    out = {"ttft_ms": ttft * 1e3, "ms_per_token": None, "tokens_per_s": None}
    if full > ttft:
        out.update(ms_per_token=(full - ttft) / (n - 1) * 1e3, tokens_per_s=(n - 1) / (full - ttft))
    else:
        out["why_no_per_token"] = (f"the {n}-token runs' median ({full * 1e3:.1f} ms) was not above the 1-token "
                                   f"runs' ({ttft * 1e3:.1f} ms): the machine's noise")
    return out
