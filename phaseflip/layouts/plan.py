"""Typed messages between the controller and a rank: what to run this step and what came back.

Owns: StepPlan (one batch mixing prefill chunks and decodes), SeqChunk, NewRequest and StepResult.
Pure data (picklable, no torch) so the same messages travel to rank processes later.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Phase(str, enum.Enum):
    PREFILL = "prefill"  # at least one chunk has more than one token or is a prompt chunk
    DECODE = "decode"    # every chunk is one generated token of a running sequence


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a step: tokens [start_pos, start_pos + len(token_ids)) of the sequence."""
    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int             # == num_computed_tokens before the step
    block_ids: tuple[int, ...]  # the sequence's block table; covers start_pos + len(token_ids) tokens
    sample: bool               # the chunk reaches the sequence's last known token: sample the next one
    decode: bool               # one generated token of a running sequence (Scheduler.wants_decode)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens of this sequence in the KV cache once the step has run."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class NewRequest:
    """Sent once, the first time a sequence is scheduled: the rank keeps its sampling state."""
    seq_id: int
    params: Any  # SamplingParams
    num_prompt_tokens: int
    prompt_token_ids: tuple[int, ...] = ()   # only where the params' repetition penalty reads them


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    phase: Phase
    chunks: tuple[SeqChunk, ...]
    new_requests: tuple[NewRequest, ...] = ()
    finished_seq_ids: tuple[int, ...] = ()  # the rank may drop their sampling state

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_seqs(self) -> int:
        return len(self.chunks)


@dataclass(frozen=True)
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float | None = None                    # of the sampled token, when logprobs were asked for
    top_logprobs: dict[int, float] | None = None    # top-N (+ the sampled token), when asked for


@dataclass(frozen=True)
class StepResult:
    step_id: int
    sampled: tuple[SampledToken, ...]  # one per chunk with sample=True, in chunk order
