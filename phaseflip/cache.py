"""Where the phaseflip cache lives: $PHASEFLIP_CACHE if set, else ~/.cache/phaseflip.

Owns: `cache_dir()`, read by everything that keeps files there (the converted default model, the CPU
kernel build, the compile caches, the last boot manifest). It imports nothing of the package, so any
layer may read it.
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$PHASEFLIP_CACHE if set, else ~/.cache/phaseflip (not created here)."""
    env = os.environ.get("PHASEFLIP_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "phaseflip"
