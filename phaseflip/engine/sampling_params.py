"""SamplingParams: how one request's next tokens are chosen and when its generation stops.

Owns: the frozen, validated, vLLM-shaped options of a request. Plain Python (no torch) so it travels to
rank processes in a NewRequest. It never samples (rank/sampler.py does) and never knows the model:
limits that depend on it (max_model_len, the vocabulary) are checked by the engine.

Normalisation done here, once, so readers see one spelling of each option:
- `top_k`: vLLM accepts 0 and -1 for "off"; -1 is stored as 0. `top_k_enabled` is `top_k > 0`.
- `stop`: a str or a list of str becomes a tuple of str; `stop_token_ids` becomes a tuple of int.
- `max_tokens=None` means "until the sequence reaches max_model_len" (as in vLLM).
- `min_tokens` (vLLM's): no stop condition but the length ones is checked before the sequence has that
  many tokens, and the EOS and stop token ids (`banned_before_min`, which the engine fills) are not drawn.
- `temperature < 1e-5` is greedy (argmax), as in vLLM; top_k/top_p/min_p/seed are then unused.
- `logit_bias`: a mapping {token_id: bias} (keys int, or str of digits as OpenAI's JSON sends them) or
  pairs; stored as a tuple of (token_id, bias) pairs sorted by id, so the params stay hashable.
  `logit_bias=None` is stored as (). Token ids beyond the vocabulary are the engine's check.
Penalties and bias follow vLLM V1: bias first, then repetition (prompt and output tokens), frequency and
presence (output tokens only); `adjusts_logits` says whether a request has any.
Options are keyword-only; an unknown option is a TypeError naming it (the dataclass __init__ does this).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GREEDY_EPS = 1e-5     # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20     # the most top-N logprobs a request may ask for (vLLM's default max_logprobs)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                   # 0 or -1: off (stored as 0)
    min_p: float = 0.0
    seed: int | None = None          # None: drawn from the engine seed and the sequence id
    max_tokens: int | None = 16      # None: until max_model_len
    stop: str | list[str] | tuple[str, ...] | None = None      # stored as tuple[str, ...]
    stop_token_ids: list[int] | tuple[int, ...] | None = None  # stored as tuple[int, ...]
    ignore_eos: bool = False
    logprobs: int | None = None      # top-N logprobs per generated token (0: the sampled token only)
    prompt_logprobs: int | None = None   # top-N per prompt token after the first (0: the prompt token only)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0    # in [-2, 2]: subtracted once from each token already generated
    frequency_penalty: float = 0.0   # in [-2, 2]: subtracted per time a token was generated
    repetition_penalty: float = 1.0  # > 0: prompt and generated tokens' logits / r (> 0) or * r (<= 0)
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None  # stored as sorted pairs
    min_tokens: int = 0              # before this many tokens no EOS, stop token or stop string ends it
    truncate_prompt_tokens: int | None = None   # k: only the prompt's last k tokens; -1: the most the
                                                # context takes (max_model_len - 1); None: the whole prompt
    bad_words: str | list[str] | tuple[str, ...] | None = None   # never generated; stored as tuple[str, ...]
    # filled by the engine where min_tokens > 0: the EOS and stop token ids, not drawn before min_tokens
    banned_before_min: tuple[int, ...] = ()
    # filled by the engine where bad_words are given: each word's token ids, alone and after a space
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        self._check_sampling()
        self._check_penalties()
        self._check_limits()
        object.__setattr__(self, "top_k", 0 if self.top_k == -1 else self.top_k)
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        object.__setattr__(self, "bad_words", _normalise_strings("bad_words", "bad word", self.bad_words))
        object.__setattr__(self, "bad_words_token_ids", tuple(
            _normalise_token_ids("bad_words_token_ids", ids) for ids in self.bad_words_token_ids))
        object.__setattr__(self, "stop_token_ids", _normalise_token_ids("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _normalise_logit_bias(self.logit_bias))
        object.__setattr__(self, "banned_before_min", _normalise_token_ids("banned_before_min",
                                                                           self.banned_before_min))

    def _check_sampling(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n={self.n!r} is invalid: must be an int >= 1")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} is invalid: must be a finite number >= 0")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} is invalid: must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} is invalid: must be an int >= 1, or 0 or -1 to disable")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p!r} is invalid: must be in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed={self.seed!r} is invalid: must be an int or None")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise ValueError(f"{name}={value!r} is invalid: must be in [-2, 2]")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} is invalid: must be a finite "
                             f"number > 0 (1 is off)")

    def _check_limits(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens={self.max_tokens!r} is invalid: must be an int >= 1, "
                             f"or None for 'until max_model_len'")
        if not _is_int(self.min_tokens) or self.min_tokens < 0 or \
                (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens={self.min_tokens!r} is invalid: must be an int >= 0 and <= max_tokens "
                             f"({self.max_tokens})")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: must be True or False")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens={k!r} is invalid: must be an int >= 1 (keep the prompt's "
                             f"last k tokens), -1 (the most max_model_len leaves room for) or None")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name}={value!r} is invalid: must be an int in [0, {MAX_LOGPROBS}] or None")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def needs_prompt_tokens(self) -> bool:
        """The repetition penalty and the prompt's logprobs read the prompt's tokens on the ranks; the other
        options do not."""
        return self.repetition_penalty != 1 or self.prompt_logprobs is not None

    @property
    def counts_output_tokens(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def adjusts_logits(self) -> bool:
        """A penalty, a bias, min_tokens' ban or a bad word changes the logits this request samples from."""
        return (self.counts_output_tokens or bool(self.logit_bias) or bool(self.banned_before_min)
                or bool(self.bad_words_token_ids))


def _normalise_stop(stop) -> tuple[str, ...]:
    return _normalise_strings("stop", "stop string", stop)


def _normalise_strings(name: str, what: str, value) -> tuple[str, ...]:
    if value is None:
        return ()
    strings = (value,) if isinstance(value, str) else value
    if not isinstance(strings, (list, tuple)):
        raise ValueError(f"{name}={value!r} is invalid: must be a str, a list of str, or None")
    for s in strings:
        if not isinstance(s, str) or not s:
            raise ValueError(f"{what} {s!r} in {name}={value!r} is invalid: must be a non-empty str")
    return tuple(strings)


def _normalise_token_ids(name: str, ids) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{name}={ids!r} is invalid: must be a list of int >= 0, or None")
    for t in ids:
        if not _is_int(t) or t < 0:
            what = "stop token id" if name == "stop_token_ids" else "token id"
            raise ValueError(f"{what} {t!r} in {name}={ids!r} is invalid: must be an int >= 0")
    return tuple(ids)


def _normalise_logit_bias(bias) -> tuple[tuple[int, float], ...]:
    if bias is None:
        return ()
    if isinstance(bias, dict):
        bias = bias.items()
    elif not isinstance(bias, (list, tuple)):
        raise ValueError(f"logit_bias={bias!r} is invalid: must be a dict {{token_id: bias}}, pairs, or None")
    pairs = {}
    for item in bias:
        token_id, value = _bias_pair(item)
        if token_id in pairs:
            raise ValueError(f"logit_bias token id {token_id} is given twice")
        pairs[token_id] = value
    return tuple(sorted(pairs.items()))


def _bias_pair(item) -> tuple[int, float]:
    if not isinstance(item, (list, tuple)) or len(item) != 2:
        raise ValueError(f"logit_bias entry {item!r} is invalid: must be a (token_id, bias) pair")
    key, value = item
    if isinstance(key, str) and key.isascii() and key.isdigit():
        key = int(key)
    if not _is_int(key) or key < 0:
        raise ValueError(f"logit_bias key {key!r} is invalid: must be a token id (an int >= 0, or a str "
                         f"of digits)")
    if not _is_real(value) or not -100 <= value <= 100:
        raise ValueError(f"logit_bias[{key}]={value!r} is invalid: must be a number in [-100, 100]")
    return key, float(value)
