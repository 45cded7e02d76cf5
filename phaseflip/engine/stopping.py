"""When a sequence is done: EOS, stop token ids, stop strings, max_tokens and max_model_len.

Owns: `check_stop`, applied after every sampled token, and the text bookkeeping stop strings need.
vLLM semantics: EOS and stop tokens stay in token_ids but not in the text (unless
include_stop_str_in_output), as vLLM's detokenizer skips the token that stop-terminated a request; a stop
string is cut from the text (unless include_stop_str_in_output) while the tokens that made it are kept.
"""
from __future__ import annotations

from dataclasses import dataclass

from phaseflip.engine.requests import Sequence


@dataclass(frozen=True)
class StopDecision:
    finish_reason: str               # "stop" | "length"
    stop_reason: int | str | None    # the stop token id or stop string; None for EOS and length


# A stop string of m characters is made by at most BYTES_PER_CHAR * m tokens (byte-level BPE can spend
# one token per UTF-8 byte); the window adds TAIL_MARGIN tokens so the few characters a decode of a
# suffix can get wrong at its start (a partial UTF-8 sequence, a stripped leading space) lie before it.
BYTES_PER_CHAR = 4
TAIL_MARGIN = 16
REPLACEMENT_CHAR = "\ufffd"   # what a decode shows for an incomplete UTF-8 sequence


def _tail_has_stop(seq: Sequence, tokenizer) -> bool:
    """Whether a stop string can have been completed by the newest token: only a suffix of the output
    is decoded each step (decoding all of it made every step cost O(output length))."""
    p = seq.params
    window = BYTES_PER_CHAR * max(len(s) for s in p.stop) + TAIL_MARGIN
    ids = seq.output_token_ids
    if len(ids) <= window:
        return True  # short output: the full decode below is as cheap
    tail = tokenizer.decode(ids[-window:], skip_special_tokens=p.skip_special_tokens)
    return any(s in tail for s in p.stop)


def _stop_string(seq: Sequence, tokenizer) -> StopDecision | None:
    p = seq.params
    if not _tail_has_stop(seq, tokenizer):
        return None
    text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=p.skip_special_tokens)
    hits = [(text.find(s), s) for s in p.stop if s in text]
    if not hits:
        return None
    at, s = min(hits)
    seq.output_text = text[:at + len(s)] if p.include_stop_str_in_output else text[:at]
    return StopDecision("stop", s)


def check_stop(seq: Sequence, tokenizer, eos_token_ids: frozenset[int], max_model_len: int) -> StopDecision | None:
    p = seq.params
    last = seq.output_token_ids[-1]
    if seq.num_output_tokens < p.min_tokens:   # only the lengths end it before min_tokens (vLLM's rule)
        return _length(seq, max_model_len)
    if not p.ignore_eos and last in eos_token_ids:
        return StopDecision("stop", None)
    if last in p.stop_token_ids:
        return StopDecision("stop", last)
    if p.stop:
        decision = _stop_string(seq, tokenizer)
        if decision is not None:
            return decision
    return _length(seq, max_model_len)


def _length(seq: Sequence, max_model_len: int) -> StopDecision | None:
    p = seq.params
    if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
        return StopDecision("length", None)
    if seq.num_tokens >= max_model_len:
        return StopDecision("length", None)
    return None


def final_text(seq: Sequence, tokenizer) -> str:
    """The output text: already cut when a stop string ended the sequence, else decoded now, without
    the EOS / stop token that ended it (a non-special stop token would otherwise show in the text), and
    without a character the last tokens left incomplete (vLLM's detokenizer never emits one)."""
    p = seq.params
    if isinstance(seq.stop_reason, str):
        return seq.output_text
    token_ids = seq.output_token_ids
    if seq.finish_reason == "stop" and not p.include_stop_str_in_output:
        token_ids = token_ids[:-1]
    return tokenizer.decode(token_ids, skip_special_tokens=p.skip_special_tokens).rstrip(REPLACEMENT_CHAR)
