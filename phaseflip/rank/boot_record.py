"""What a rank's boot measured for one layout, kept under the phaseflip cache for the next boot.

Owns: `record_key` (what the measured choices and the compiled graphs depend on: the machine, the
model, the dtype, how the weights are stored, the layout and this rank's shard of it, the step shapes,
torch, the CPU kernels' build and phaseflip's own source), `key_digest` (the key as a short name), and `BootRecord` (one
layout's record: the product forms, the one-row form, the LM head and the compile choice per role and
bucket, each report with the numbers it was made from, and when it was made). A boot whose key finds a
record takes its choices from it and measures nothing; `--remeasure` (EngineConfig.remeasure) or any
changed key field measures again and writes the record anew.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import platform
from pathlib import Path

import torch

import phaseflip
from phaseflip.cache import cache_dir, key_digest, prune, read_record, used, write_record
from phaseflip.kernels.cpu import library, quant

RECORD_VERSION = 1
# the most recently used records and saved-step directories kept (each source edit makes new keys; a
# directory of saved steps is ~5 MB for SmolLM2)
KEEP_RECORDS, KEEP_STEPS = 64, 16
# the reports a record keeps: the forms measured in rank/runtime.py, the compile choices of
# rank/compile_choice.py (per role, and the LM head)
RECORDED = ("ladder", "small_rows", "wide_rows", "block_rows", "gemv", "head", "prefill", "decode")


@functools.cache
def source_digest() -> str:
    """sha256 of phaseflip's own source (Python and C++): a compiled step's bytecode and graphs come
    from it, and the measured choices from its kernels."""
    root = Path(phaseflip.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cpp", ".h")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def machine() -> str:
    """The CPU's model, its flags' digest and core count (the kernels are built -march=native)."""
    name, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not name.strip():
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = hashlib.sha256(line.encode()).hexdigest()[:12]
    except OSError:
        pass
    return f"{name}; flags {flags}; {os.cpu_count()} cpus"


def kernels_build(device: str) -> str | None:
    """The CPU kernels' library (its name carries its build's digest) on the CPU, where it loads."""
    if device != "cpu":
        return None
    library.few_rows_op()   # builds (once per machine) and loads them, as the boot's products will
    return library.kernel_report().get("path")


def record_key(runner, device: str, compile_mode: str, kernels: str | None,
               block_products: str | None = None) -> dict:
    """What this rank's choices and compiled graphs for runner's layout depend on (block_products: how
    products on GGUF blocks take x, engine/boot.py)."""
    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None
    return {"version": RECORD_VERSION, "machine": machine(), "gpu": gpu, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "kernels": kernels, "source": source_digest(),
            "model": repr(runner.cfg), "dtype": str(runner.weights.dtype),
            "weights": sorted({quant.storage(t) for t in runner.weights.tensors().values()}),
            "layout": runner.layout, "shard": repr(runner.shard), "ranks": len(runner.shards),
            "block_table": (runner.shapes.max_blocks_per_seq, runner.shapes.block_size),
            "shapes": repr(runner.shapes), "samples_in_step": runner.samples_in_step,
            "compile": compile_mode, "block_products": block_products}


# key fields a compiled step does not depend on: the buckets (its guards take the shapes it serves),
# where the boot samples, the compile mode, how the products on blocks (opaque calls) take x
NOT_IN_GRAPHS = ("shapes", "samples_in_step", "compile", "block_products")


@dataclasses.dataclass
class BootRecord:
    """One layout's measured choices for one key; `reports` is empty where nothing was recorded."""
    key: dict
    path: Path
    reports: dict = dataclasses.field(default_factory=dict)
    made_at: str | None = None

    @classmethod
    def load(cls, key: dict, remeasure: bool = False, root: Path | None = None) -> "BootRecord":
        """The record of `key` under root (the phaseflip cache's records/), empty where there is none
        (or remeasure, or it cannot be read)."""
        path = (root or cache_dir() / "records") / f"{key_digest(key)}.json"
        data = None if remeasure else read_record(path, key, object_hook=_int_keys)
        if data is None:
            return cls(key, path)
        record = cls(key, path, data.get("reports", {}), data.get("made_at"))
        used(record.steps_dir)
        return record

    @property
    def steps_dir(self) -> Path:
        """Where the compiled steps of this key are kept (graphs/saved_steps.py): one directory for
        every key that differs only in NOT_IN_GRAPHS."""
        graphs = {k: v for k, v in self.key.items() if k not in NOT_IN_GRAPHS}
        return self.path.parent.parent / "steps" / key_digest(graphs)

    def get(self, what: str) -> dict | None:
        return self.reports.get(what)

    def save(self, reports: dict) -> None:
        """Keep `reports` (what -> report) under this key: written whole, then renamed."""
        self.reports = {what: reports[what] for what in RECORDED if what in reports}
        self.made_at = write_record(self.path, self.key, {"reports": self.reports}, KEEP_RECORDS)
        prune(self.steps_dir.parent, KEEP_STEPS, protect=self.steps_dir)

    def summary(self, used: bool) -> dict:
        """What the manifest (and `phaseflip inspect`) says about the record."""
        return {"path": str(self.path), "made_at": self.made_at, "used": used}


def _int_keys(obj: dict) -> dict:
    """JSON writes the reports' row counts and buckets as strings: read them back as the ints they were."""
    return {int(k) if k.isdigit() else k: v for k, v in obj.items()}
