"""Where the phaseflip cache lives: $PHASEFLIP_CACHE if set, else ~/.cache/phaseflip.

Owns: `cache_dir()`, read by everything that keeps files there (the converted default model, the CPU
kernel build, the compile caches, the last boot manifest, the boot records and saved steps), and the
bound on what accumulates there: `used` marks an entry as just used, `prune` keeps a directory's most
recently used entries. Every change of phaseflip's sources, torch or the machine makes new keys, so
without a bound the records, saved steps and kernel builds would grow with every edit. It imports
nothing of the package, so any layer may read it.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def cache_dir() -> Path:
    """$PHASEFLIP_CACHE if set, else ~/.cache/phaseflip (not created here)."""
    env = os.environ.get("PHASEFLIP_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "phaseflip"


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


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:
        return 0.0
