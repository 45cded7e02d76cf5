"""Random API inputs for test_fuzz.py, each with the validation error it must raise (or None).

random_prompt -> (prompt, None | (exception type, text the message must contain: the bad value));
random_params -> SamplingParams, or (kwargs, None | the bad value's repr) with as_kwargs=True.
"""
from __future__ import annotations

import random

import numpy as np

from phaseflip import SamplingParams
from tests.reliability.support import MAX_MODEL_LEN

VOCAB = 384
TEXT_POOLS = ("abc xyz The quick brown fox", "日本語のテキスト", "🎉🚀👍🏽", "e\u0301a\u0308", "\u200b\u200d\ufeff",
              "\x00\x01\t\n", "مرحبا שלום", "Ωμέγα ∑∫√")


def _text(rng: random.Random) -> str:
    pool = "".join(TEXT_POOLS)
    return "".join(rng.choice(pool) for _ in range(rng.randrange(1, 30)))


def _valid(rng: random.Random):
    kind = rng.randrange(5)
    if kind == 0:
        return _text(rng)
    ids = [rng.randrange(0, VOCAB) for _ in range(rng.randrange(1, 60))]
    if kind == 1:
        return ids
    if kind == 2:
        return [np.int64(t) for t in ids]
    return {"prompt": _text(rng)} if kind == 3 else {"prompt_token_ids": tuple(ids)}


def _invalid(rng: random.Random):
    ids = [rng.randrange(0, VOCAB) for _ in range(rng.randrange(1, 10))]
    at = rng.randrange(len(ids))
    kind = rng.randrange(7)
    if kind == 0:
        bad = rng.choice([-1, VOCAB, 10**12])
        return ids[:at] + [bad] + ids[at:], (ValueError, f"token id {bad} is outside the vocabulary")
    if kind == 1:
        bad = rng.choice([2.0, "5", None, True])
        return ids[:at] + [bad] + ids[at:], (TypeError, f"token {at} is {bad!r}")
    if kind == 2:
        return rng.choice(["", [], {"prompt": ""}]), (ValueError, "is empty")
    if kind == 3:
        return "ok\ud800", (ValueError, "'\\ud800'")
    if kind == 4:
        n = rng.randrange(MAX_MODEL_LEN, MAX_MODEL_LEN + 50)
        return [7] * n, (ValueError, f"has {n} tokens, but max_model_len={MAX_MODEL_LEN}")
    if kind == 5:
        return {"text": "hi"}, (ValueError, "got keys ['text']")
    bad = rng.choice([3.5, None, b"bytes"])
    return bad, (TypeError, repr(bad))


def random_prompt(rng: random.Random, bad_rate: float):
    return _invalid(rng) if rng.random() < bad_rate else (_valid(rng), None)


# option -> (valid values, invalid values); the invalid value's repr must be in the error message
OPTIONS = {
    "temperature": ([0.0, 0.5, 1.0, 2.0], [-1.0, float("nan"), float("inf"), "1", True]),
    "top_p": ([0.5, 0.9, 1.0], [0.0, 1.5, float("nan")]),
    "top_k": ([0, -1, 1, 50], [-2, 1.5, True]),
    "min_p": ([0.0, 0.1], [-0.1, 2]),
    "seed": ([None, 0, 2**70, -3], ["x", 1.0]),
    "max_tokens": ([1, 5, 16], [0, -1, 2.5, True]),
    "stop": ([None, "a", ["xy", "z"], ("q",)], ["", [""], [1], 5]),
    "stop_token_ids": ([None, [2], [10**6]], [[-1], ["a"], 3]),
    "logprobs": ([None, 0, 3], [21, -1, True]),
    "ignore_eos": ([True, False], ["no", 1]),
    "include_stop_str_in_output": ([True, False], [None]),
    "n": ([1], [0, -2]),
}


def _bad_repr(name: str, value) -> str:
    """What the message must contain: the bad element for a list option, else the value."""
    if name in ("stop", "stop_token_ids") and isinstance(value, list):
        return repr(value[0])
    return repr(value)


def random_params(rng: random.Random, bad_rate: float, as_kwargs: bool = False, max_tokens: int | None = None):
    kwargs = {name: rng.choice(valid) for name, (valid, _) in OPTIONS.items() if rng.random() < 0.6}
    bad = None
    if rng.random() < bad_rate:
        name = rng.choice(list(OPTIONS))
        kwargs[name] = rng.choice(OPTIONS[name][1])
        bad = _bad_repr(name, kwargs[name])
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    if as_kwargs:
        return kwargs, bad
    return SamplingParams(**kwargs)
