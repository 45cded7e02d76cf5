"""The logprobs of a prompt's tokens (SamplingParams.prompt_logprobs), from a prefill step's hidden
states on the ranks that hold the head.

Owns: `prompt_logprobs`: for each chunk of the step whose sequence asked, the logprob of every prompt
token the chunk's rows predict (row at position p predicts the prompt token at p + 1, while there is
one) and the top-N there, computed from the raw logits (no temperature, penalty or bias, as vLLM
reports them). Logits are made ROWS_AT_ONCE rows at a time: a whole prefill's [tokens, vocab] would be
hundreds of MB. On a tensor-parallel layout every head rank calls it (the logits' vocab shares are
gathered to the output rank, a collective); only the output rank returns them.
"""
from __future__ import annotations

from typing import Callable

import torch

from phaseflip.rank.messages import PromptLogprobs, StepBatch

ROWS_AT_ONCE = 64


def prompt_logprobs(hidden: torch.Tensor, batch: StepBatch, asked: Callable[[int], tuple | None],
                    logits_of: Callable[[torch.Tensor], torch.Tensor | None]) -> tuple[PromptLogprobs, ...]:
    """hidden: [T, H], the step's final-normed rows in chunk order; asked(seq_id): (top-N, prompt) of a
    sequence that asked, else None; logits_of(rows): their full-vocab logits on the output rank (None on
    the other ranks, which must still call it: a collective)."""
    found, row = [], 0
    for c in batch.chunks:
        wanted = asked(c.seq_id)
        # rows whose next token is a prompt token: positions start_pos .. len(prompt) - 2
        count = 0 if wanted is None else max(0, min(c.num_tokens, len(wanted[1]) - 1 - c.start_pos))
        if count:
            targets = wanted[1][c.start_pos + 1:c.start_pos + 1 + count]
            lps = _logprobs(hidden[row:row + count], targets, wanted[0], logits_of)
            if lps is not None:
                found.append(PromptLogprobs(c.seq_id, c.start_pos, lps))
        row += c.num_tokens
    return tuple(found)


def _logprobs(hidden: torch.Tensor, targets: tuple[int, ...], top_n: int,
              logits_of: Callable[[torch.Tensor], torch.Tensor | None]) -> tuple[dict[int, float], ...] | None:
    out: list[dict[int, float]] = []
    for a in range(0, hidden.shape[0], ROWS_AT_ONCE):
        logits = logits_of(hidden[a:a + ROWS_AT_ONCE])
        if logits is None:   # not the output rank: it took part in the gather only
            continue
        logp = logits.float().log_softmax(dim=-1)                                  # [n, V]
        ids = torch.tensor(targets[a:a + ROWS_AT_ONCE], device=logp.device)
        picked = logp.gather(1, ids[:, None]).squeeze(1).tolist()
        top_values, top_ids = logp.topk(top_n, dim=-1) if top_n else (logp[:, :0], logp[:, :0].long())
        for t, lp, tv, ti in zip(ids.tolist(), picked, top_values.tolist(), top_ids.tolist()):
            top = dict(zip(ti, tv))
            top.setdefault(t, lp)
            out.append(top)
    return tuple(out) if out else None
