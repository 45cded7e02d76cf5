"""Normalising and validating the prompts and sampling params a user hands to generate().

Owns: turning str / list[str] / list[list[int]] / {"prompt"| "prompt_token_ids"} into token ids, and
every up-front check, so a bad request raises (naming its index and the bad value) before any runs.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

from phaseflip.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class PreparedPrompt:
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise TypeError(f"prompts must be a str, a list of str or a list of token-id lists; got {type(prompts).__name__}")


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _tokens(i: int, p, tokenizer) -> tuple[str | None, list[int]]:
    if isinstance(p, dict):
        if "prompt_token_ids" in p:
            return None, _token_ids(i, p["prompt_token_ids"])
        if "prompt" not in p:
            raise ValueError(f"prompt {i}: a dict prompt needs 'prompt' or 'prompt_token_ids'; got keys {sorted(p)}")
        p = p["prompt"]
    if isinstance(p, str):
        return p, tokenizer.encode(_text(i, p))
    if isinstance(p, (list, tuple)):
        return None, _token_ids(i, p)
    raise TypeError(f"prompt {i} must be a str or a list of int token ids; got {type(p).__name__} {_short(p)}")


def _text(i: int, p: str) -> str:
    if not p:
        raise ValueError(f"prompt {i} is empty: give at least one character or token")
    try:
        p.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"prompt {i} is not valid Unicode: character {e.start} is {p[e.start]!r} "
                         f"(a lone surrogate cannot be encoded as UTF-8)") from None
    return p


def _token_ids(i: int, ids) -> list[int]:
    """ids as plain ints; any integer type but bool (numpy's included) is a token id."""
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"prompt {i}: prompt_token_ids must be a list of int token ids; got "
                        f"{type(ids).__name__} {_short(ids)}")
    for j, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"prompt {i}: token {j} is {_short(t)} ({type(t).__name__}), not an int token id")
    return [int(t) for t in ids]


def _params_list(n: int, sampling_params) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts: pass one, or one per prompt")
    for i, sp in enumerate(params):
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling_params[{i}] is a {type(sp).__name__}, not a SamplingParams")
    return params


def prepare_prompts(prompts, sampling_params, tokenizer, *, vocab_size: int, max_model_len: int,
                    max_tokens_in_pool: int | None, eos_token_ids: frozenset[int] = frozenset()
                    ) -> list[PreparedPrompt]:
    """Each prompt as token ids with its params (cut to its last truncate_prompt_tokens where the params
    say so), checked: not empty, in the vocabulary, shorter than max_model_len and, where the pool bounds
    a sequence (max_tokens_in_pool; None: it does not), within it.
    Params with min_tokens get the ids the sampler bans before it: the EOS ids (unless ignored) and the
    request's stop token ids; params with bad_words get each word's token ids."""
    items = _as_list(prompts)
    params = _params_list(len(items), sampling_params)
    filled: dict[int, SamplingParams] = {}   # by id(params): one list of params often serves every prompt
    out = []
    for i, (p, sp) in enumerate(zip(items, params)):
        text, ids = _tokens(i, p, tokenizer)
        kept = _truncated(ids, sp.truncate_prompt_tokens, max_model_len)
        if len(kept) < len(ids) and text is not None:   # the prompt reported (and echoed) is the one that runs
            text = tokenizer.decode(kept, skip_special_tokens=False)
        ids = kept
        if not ids:
            raise ValueError(f"prompt {i} is empty (0 tokens): give at least one token")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        biased = [t for t, _ in sp.logit_bias if t >= vocab_size]
        if biased:
            raise ValueError(f"request {i}: logit_bias token id {biased[0]} is outside the vocabulary "
                             f"[0, {vocab_size})")
        if len(ids) >= max_model_len:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, but max_model_len={max_model_len} leaves "
                             f"no room to generate: prompts must be shorter than {max_model_len} tokens")
        if max_tokens_in_pool is not None and len(ids) + 1 > max_tokens_in_pool:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, but the KV pool holds only "
                             f"{max_tokens_in_pool} tokens in all: it could never run; raise "
                             f"num_kv_blocks or kv_cache_memory_gib")
        if id(sp) not in filled:
            filled[id(sp)] = _with_min_tokens_ban(_with_bad_words(sp, tokenizer), eos_token_ids)
            outside = [t for word in filled[id(sp)].bad_words_token_ids for t in word if t >= vocab_size]
            if outside:
                raise ValueError(f"request {i}: a bad word tokenizes to id {outside[0]}, outside the model's "
                                 f"vocabulary [0, {vocab_size})")
        out.append(PreparedPrompt(text, ids, filled[id(sp)]))
    return out


def _truncated(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The prompt's last `keep` tokens (-1: the most a prompt may have, max_model_len - 1), as vLLM cuts
    from the left."""
    if keep is None:
        return ids
    keep = max_model_len - 1 if keep == -1 else keep
    return ids[-keep:] if len(ids) > keep else ids


def _with_min_tokens_ban(sp: SamplingParams, eos_token_ids: frozenset[int]) -> SamplingParams:
    if sp.min_tokens == 0 or sp.banned_before_min:
        return sp
    banned = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_token_ids))
    return dataclasses.replace(sp, banned_before_min=tuple(sorted(banned))) if banned else sp


def _with_bad_words(sp: SamplingParams, tokenizer) -> SamplingParams:
    """Each bad word's token ids as vLLM finds them: the word alone (spaces before it stripped) and, where
    a space before it gives as many tokens but another first one, after a space (a word that begins the
    text, and one in the middle of it)."""
    if not sp.bad_words or sp.bad_words_token_ids:
        return sp
    found: list[tuple[int, ...]] = []
    for word in sp.bad_words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        variants = [alone] + ([spaced] if spaced[:1] != alone[:1] and len(spaced) == len(alone) else [])
        found += [ids for ids in variants if ids and ids not in found]
    return dataclasses.replace(sp, bad_words_token_ids=tuple(found))
