"""A model's generation_config.json: the sampling defaults its authors ship, and its end-of-sequence ids.

Owns: `GenerationDefaults` (the SamplingParams fields the file sets: temperature, top_p, top_k, min_p,
repetition_penalty, and max_new_tokens as max_tokens; the eos ids it lists) and
`load_generation_defaults` (a model directory's file, or nothing: a GGUF file, a model without one).
vLLM's behaviour: a request that leaves one of these fields unset gets the file's value; one that sets
it keeps its own. Values are checked by SamplingParams when a request is built from them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from phaseflip.engine.checkpoint.loader import CheckpointError

FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict = field(default_factory=dict)   # SamplingParams field -> the file's value
    eos_token_ids: tuple[int, ...] = ()
    source: str | None = None                      # the file read (None: there was none)

    def __post_init__(self):
        unknown = set(self.sampling) - set(SAMPLING_KEYS.values())
        if unknown:
            raise ValueError(f"not SamplingParams defaults: {sorted(unknown)}")

    def fill(self, given: dict, names_set: set[str]) -> dict:
        """`given` (SamplingParams keyword arguments) with the defaults for every field not in names_set."""
        return {**given, **{k: v for k, v in self.sampling.items() if k not in names_set}}


def load_generation_defaults(model: str | Path) -> GenerationDefaults:
    """The defaults of the model directory's generation_config.json (none for a GGUF file or a directory
    without the file); a file that is not a JSON object, or a sampling value that is not a number, is a
    CheckpointError naming it."""
    path = Path(model) / FILE
    if not path.is_file():
        return GenerationDefaults()
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read it as JSON ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    sampling = {}
    for key, name in SAMPLING_KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"{path}: field {key!r} must be a number, got {value!r}")
        sampling[name] = value
    eos = raw.get("eos_token_id")
    ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(f"{path}: field 'eos_token_id' must be an int or a list of ints, got {eos!r}")
    return GenerationDefaults(sampling, tuple(ids), str(path))
