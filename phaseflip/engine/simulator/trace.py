"""Arrival traces for the simulator: one TraceRequest per JSONL line (arrival time, prompt and output
lengths, the max_tokens the engine is told), validated and sorted by arrival.

Must never: import torch.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from phaseflip.engine.simulator.rig import RIGS_DIR
from phaseflip.engine.validate import count


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int      # what it will really generate
    max_tokens: int         # what the engine is told (an upper bound; the policy sees only this)

    def __post_init__(self) -> None:
        if not (isinstance(self.arrival_s, (int, float)) and math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise ValueError(f"arrival_s must be a number >= 0, got {self.arrival_s!r}")
        for name in ("prompt_tokens", "output_tokens", "max_tokens"):
            count(getattr(self, name), name)
        if self.output_tokens > self.max_tokens:
            raise ValueError(f"output_tokens={self.output_tokens} exceeds max_tokens={self.max_tokens}")


def load_trace(path) -> tuple[TraceRequest, ...]:
    """JSONL: {"arrival_s", "prompt_tokens", "output_tokens"[, "max_tokens"][, "kind"]} per line."""
    p = Path(path)
    if not p.exists() and (RIGS_DIR / path).exists():
        p = RIGS_DIR / path
    requests = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            requests.append(TraceRequest(obj["arrival_s"], obj["prompt_tokens"], obj["output_tokens"],
                                         obj.get("max_tokens", obj["output_tokens"])))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{p} line {n}: {e!r}") from e
    if not requests:
        raise ValueError(f"{p} holds no requests")
    return tuple(sorted(requests, key=lambda r: r.arrival_s))
