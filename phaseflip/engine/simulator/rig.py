"""Rig profiles for the simulator: loading one (a JSON file, or a shipped one by name from tools/rigs/) and
validating it into a Rig: layout rates, per-leg flip samples and priors, engine limits. Every number in a
profile must be labelled measured / derived / assumption (check_labels).

Must never: import torch.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from phaseflip.engine.policy.estimators import LayoutRates, direction
from phaseflip.engine.validate import count

BASES = ("measured", "derived", "assumption")
RIGS_DIR = Path(__file__).resolve().parents[2] / "tools" / "rigs"


def check_labels(node, path: str = "rig") -> None:
    """Every number in a rig profile sits in a {"value": ..., "basis": "measured|derived|assumption: ..."}."""
    if isinstance(node, dict) and "value" in node:
        basis = node.get("basis")
        if not isinstance(basis, str) or not basis.startswith(BASES):
            raise ValueError(f"{path}: basis must start with one of {', '.join(BASES)}, got {basis!r}")
        return
    if isinstance(node, dict):
        for key, child in node.items():
            check_labels(child, f"{path}.{key}")
    elif isinstance(node, list):
        for i, child in enumerate(node):
            check_labels(child, f"{path}[{i}]")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        raise ValueError(f"{path}: the number {node} is not labelled (wrap it as {{'value', 'basis'}})")


def _value(node: dict, key: str, path: str):
    if key not in node or not isinstance(node[key], dict) or "value" not in node[key]:
        raise ValueError(f"{path}.{key} is missing (a {{'value', 'basis'}} object)")
    return node[key]["value"]


def _positive(x, path: str) -> float:
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x) or x <= 0:
        raise ValueError(f"{path} must be a number > 0, got {x!r}")
    return float(x)


@dataclass(frozen=True)
class Rig:
    name: str
    layouts: Mapping[str, LayoutRates]           # what the rig really does (and what boot calibrates)
    mixed_step_shared: Mapping[str, float]       # share of a batch-of-one decode step a mixed step saves
    flip_samples_s: Mapping[str, tuple[float, ...]]  # per direction, used in turn
    flip_prior_s: Mapping[str, float]            # the estimators' seeds
    max_num_seqs: int
    chunk_tokens: int
    block_size: int
    num_kv_blocks: int
    idle_poll_s: float
    failed_flip_fraction: float

    def flip_s(self, leg: str, n: int) -> float:
        samples = self.flip_samples_s[leg]
        return samples[n % len(samples)]


def rig_from_dict(raw: dict) -> Rig:
    check_labels(raw)
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("rig.name must be a non-empty string")
    eng = raw.get("engine") or {}
    raw_layouts = raw.get("layouts") or {}
    if set(raw_layouts) != {"pp", "tp"}:
        raise ValueError(f"rig.layouts must define pp and tp, got {sorted(raw_layouts)}")
    layouts = {k: _layout_from_dict(k, v) for k, v in raw_layouts.items()}
    shared = {k: _fraction(_value(v, "mixed_step_shared", f"rig.layouts.{k}"), f"rig.layouts.{k}.mixed_step_shared")
              for k, v in raw_layouts.items()}
    flips = raw.get("flips") or {}
    legs = (direction("pp", "tp"), direction("tp", "pp"))
    samples, priors = {}, {}
    for leg in legs:
        node = flips.get(leg) or {}
        values = _value(node, "samples_s", f"rig.flips.{leg}")
        if not isinstance(values, list) or not values:
            raise ValueError(f"rig.flips.{leg}.samples_s must be a non-empty list")
        samples[leg] = tuple(_positive(x, f"rig.flips.{leg}.samples_s") for x in values)
        priors[leg] = _positive(_value(node, "prior_s", f"rig.flips.{leg}"), f"rig.flips.{leg}.prior_s")
    fraction = _fraction(_value(flips, "failed_flip_fraction", "rig.flips"), "rig.flips.failed_flip_fraction")
    return Rig(name, MappingProxyType(layouts), MappingProxyType(shared), MappingProxyType(samples),
               MappingProxyType(priors),
               max_num_seqs=count(_value(eng, "max_num_seqs", "rig.engine"), "rig.engine.max_num_seqs"),
               chunk_tokens=count(_value(eng, "chunk_tokens", "rig.engine"), "rig.engine.chunk_tokens"),
               block_size=count(_value(eng, "block_size", "rig.engine"), "rig.engine.block_size"),
               num_kv_blocks=count(_value(eng, "num_kv_blocks", "rig.engine"), "rig.engine.num_kv_blocks"),
               idle_poll_s=_positive(_value(eng, "idle_poll_s", "rig.engine"), "rig.engine.idle_poll_s"),
               failed_flip_fraction=fraction)


def _fraction(x, path: str) -> float:
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not 0 <= x <= 1:
        raise ValueError(f"{path} must be a number in [0, 1], got {x!r}")
    return float(x)


def _layout_from_dict(name: str, node: dict) -> LayoutRates:
    path = f"rig.layouts.{name}"
    prefill = _positive(_value(node, "prefill_tok_s", path), f"{path}.prefill_tok_s")
    table = _value(node, "decode_step_s", path)
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{path}.decode_step_s must be a non-empty {{batch: seconds}} object")
    steps = sorted((count(int(b), f"{path}.decode_step_s batch"), _positive(s, f"{path}.decode_step_s[{b}]"))
                   for b, s in table.items())
    return LayoutRates(name, prefill, tuple(steps))


def load_rig(path) -> Rig:
    """A rig profile from a JSON file, or a shipped one by name (see tools/rigs/)."""
    p = Path(path)
    if not p.exists() and (RIGS_DIR / f"{path}.json").exists():
        p = RIGS_DIR / f"{path}.json"
    if not p.exists():
        shipped = ", ".join(sorted(f.stem for f in RIGS_DIR.glob("*.json")))
        raise ValueError(f"no rig profile {str(path)!r} (a JSON file, or one of: {shipped})")
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not JSON: {e}") from e
    return rig_from_dict(raw)
