"""Where the phaseflip cache lives: $PHASEFLIP_CACHE if set, else ~/.cache/phaseflip.

Owns: `cache_dir()`, read by everything that keeps files there (the converted default model, the CPU
kernel build, the compile caches, the last boot manifest, the boot records and saved steps), the
bound on what accumulates there: `used` marks an entry as just used, `prune` keeps a directory's most
recently used entries, and keyed records (`read_record` / `write_record`: a JSON file named by its
key's digest, holding the key, so a digest collision or an edited file is never taken for the key),
and `cpu_flags`, in the key of whatever is built for this CPU.
Every change of phaseflip's sources, torch or the machine makes new keys, so without a bound the
records, saved steps and kernel builds would grow with every edit. It imports nothing of the package,
so any layer may read it.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
from pathlib import Path


def cache_dir() -> Path:
    """$PHASEFLIP_CACHE if set, else ~/.cache/phaseflip (not created here)."""
    env = os.environ.get("PHASEFLIP_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "phaseflip"


def cpu_flags() -> str:
    """The CPU's flags line of /proc/cpuinfo (elsewhere, the processor's name): in the key of whatever
    is built for this CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def used(path: Path) -> None:
    """Mark a cache entry (file or directory) as just used: `prune` keeps the most recently used."""
    try:
        os.utime(path)
    except OSError:
        pass   # gone or not ours to touch: nothing to keep


def prune(directory: Path, keep: int, protect: Path | None = None, suffix: str = "") -> list[Path]:
    """Delete all but the `keep` most recently used entries of directory whose names end in suffix
    (never `protect`, nor unfinished *.tmp files); returns what was deleted. Entries another process
    deletes meanwhile are skipped."""
    try:
        entries = [p for p in directory.iterdir() if p.name.endswith(suffix) and not p.name.endswith(".tmp")]
    except OSError:
        return []
    others = sorted((p for p in entries if p != protect), key=_mtime, reverse=True)
    doomed = others[max(0, keep - (len(others) < len(entries))):]
    for p in doomed:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return doomed


def key_digest(key: dict) -> str:
    """A key (JSON-able) as a short file name."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def read_record(path: Path, key: dict, object_hook=None) -> dict | None:
    """The record written at `path` for exactly `key` (compared as JSON gives it back: tuples as
    lists), marked as used; None where there is none, it cannot be read, or it holds another key."""
    try:
        data = json.loads(path.read_text(), object_hook=object_hook)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != json.loads(json.dumps(key, default=str)):
        return None
    used(path)
    return data


def write_record(path: Path, key: dict, body: dict, keep: int) -> str:
    """Write {key, made_at, **body} at `path` whole, then rename (a reader never sees half a record), and
    keep the `keep` most recently used records of its directory; returns made_at."""
    made_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "made_at": made_at, **body}, indent=1, default=str))
    os.replace(tmp, path)
    prune(path.parent, keep, protect=path, suffix=".json")
    return made_at


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:
        return 0.0
