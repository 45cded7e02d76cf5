"""Penalties and logit bias on the output rank: a sequence's state and the logits it samples from.

Owns: for a sequence whose SamplingParams adjust its logits (`params.adjusts_logits`), the counts of the
tokens it generated (int32 [V], one add per sampled token) and, for the repetition penalty, its prompt's
tokens as a bool [V] mask; both are made at its first sampled step, on the logits' device, so a rank
that never samples a sequence keeps no tensor for it. And the maths, vLLM V1's and in its order:
logit_bias added; the repetition penalty on tokens of the prompt or the output (logit / r where it is
> 0, logit * r otherwise); the frequency (x count) and presence (x (count > 0)) penalties subtracted,
over the output's tokens only; before min_tokens, the EOS and stop token ids at -inf; a bad word's last
token at -inf where the output ends with the tokens before it (a one-token word always), as vLLM bans
them. It never draws a token (sampler.py and draw.py do, from the adjusted logits).
"""
from __future__ import annotations

from collections import deque

import torch


class SeqPenalties:
    def __init__(self, params, prompt_token_ids: tuple[int, ...] = ()):
        self.params = params   # SamplingParams
        self.prompt_token_ids = prompt_token_ids
        self.counts: torch.Tensor | None = None        # int32 [V]: times each token was generated
        self.prompt_mask: torch.Tensor | None = None   # bool [V]: tokens of the prompt
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None   # (ids int64 [B], values float32 [B])
        self.generated = 0   # tokens sampled so far (min_tokens' ban holds until params.min_tokens)
        self.banned: torch.Tensor | None = None   # int64 [B]: params.banned_before_min on the logits' device
        longest = max(map(len, params.bad_words_token_ids), default=1)
        self.recent: deque[int] = deque(maxlen=longest - 1)   # the output's last tokens a bad word may end

    def adjust(self, row: torch.Tensor) -> None:
        """row: one sequence's float32 logits [V], adjusted in place."""
        p = self.params
        if p.banned_before_min and self.generated < p.min_tokens:
            if self.banned is None:
                self.banned = torch.tensor(p.banned_before_min, dtype=torch.int64, device=row.device)
            row[self.banned] = float("-inf")
        if p.bad_words_token_ids:
            row[self._bad_words_due()] = float("-inf")
        if p.logit_bias:
            row.index_add_(0, *self._bias(row.device))
        if not p.counts_output_tokens:
            return
        counts = self._counts(row)
        seen = counts > 0                                                                  # [V]
        if p.repetition_penalty != 1:
            repeated = seen | self._prompt_mask(row)
            r = p.repetition_penalty
            row.copy_(torch.where(repeated, torch.where(row > 0, row / r, row * r), row))
        if p.frequency_penalty != 0:
            row -= p.frequency_penalty * counts
        if p.presence_penalty != 0:
            row -= p.presence_penalty * seen

    def record(self, token_id: int) -> None:
        """The sequence generated token_id (after `adjust` at the same step, which made the counts)."""
        self.generated += 1
        if self.counts is not None:
            self.counts[token_id] += 1
        if self.recent.maxlen:
            self.recent.append(token_id)

    def _bad_words_due(self) -> list[int]:
        """The last token of every bad word whose other tokens the output ends with now."""
        recent = tuple(self.recent)
        return [ids[-1] for ids in self.params.bad_words_token_ids
                if len(ids) == 1 or recent[-(len(ids) - 1):] == ids[:-1]]

    def _bias(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.bias is None:
            ids, values = zip(*self.params.logit_bias)
            self.bias = (torch.tensor(ids, dtype=torch.int64, device=device),
                         torch.tensor(values, dtype=torch.float32, device=device))
        return self.bias

    def _counts(self, row: torch.Tensor) -> torch.Tensor:
        if self.counts is None:
            self.counts = torch.zeros(row.shape[0], dtype=torch.int32, device=row.device)
        return self.counts

    def _prompt_mask(self, row: torch.Tensor) -> torch.Tensor:
        if self.prompt_mask is None:
            self.prompt_mask = torch.zeros(row.shape[0], dtype=torch.bool, device=row.device)
            self.prompt_mask[torch.tensor(self.prompt_token_ids, dtype=torch.int64, device=row.device)] = True
        return self.prompt_mask


def adjusted_logits(logits: torch.Tensor, penalties: list[SeqPenalties | None]) -> torch.Tensor:
    """logits [n, V] float32, row i of a sequence whose state is penalties[i] (None: none asked). The
    logits themselves where no row asks, else a copy with each asking row adjusted (the raw logits
    stay for logprobs)."""
    if not any(penalties):
        return logits
    out = logits.clone()
    for row, state in zip(out, penalties):
        if state is not None:
            state.adjust(row)
    return out


def record_tokens(penalties: list[SeqPenalties | None], token_ids: list[int]) -> None:
    for state, token_id in zip(penalties, token_ids):
        if state is not None:
            state.record(token_id)
