"""Request state on the controller and the vLLM-shaped outputs handed back to users.

Owns: Sequence (the mutable per-request state the scheduler and block allocator act on), the frozen
output records RequestOutput / CompletionOutput / RequestMetrics, and Logprob (the values of their
logprobs dicts). Plain Python: no torch here.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request as the scheduler sees it.

    `num_computed_tokens` counts tokens whose KV is in the cache. After a preemption (recompute) it
    drops to 0 and the prompt plus the tokens generated so far are prefilled again.
    """
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: Any  # SamplingParams (engine/sampling_params.py)
    arrival_time: float = 0.0
    prompt_text: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # prefix keys of its full blocks (prefix_cache.py)
    num_cached_blocks: int = 0                              # of block_ids, those entered in the prefix cache
    num_dropped_blocks: int = 0          # leading block_ids given back: behind every layer's sliding window
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None     # "stop" | "length"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    output_text: str = ""
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None   # [None, then one per prompt token]
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def tokens_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + outputs, without building the concatenation (per step)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:stop - n]
        return self.prompt_token_ids[start:stop] + self.output_token_ids[:max(0, stop - n)]


@dataclass(frozen=True)
class RequestMetrics:
    """Times in seconds (time.perf_counter clock). A time that was not observed is None."""
    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    time_to_first_token: float | None
    token_times: tuple[float, ...]  # per output token, seconds since arrival
    num_preemptions: int


class Logprob(float):
    """A token's log-probability: a float, with the fields of vLLM's Logprob for code written against its
    offline API: `logprob`, `rank` (1 for the most likely token; None where not computed: a sampled token
    below the top-N) and `decoded_token` (None: not decoded here)."""
    __slots__ = ("rank", "decoded_token")

    def __new__(cls, value: float, rank: int | None = None, decoded_token: str | None = None):
        self = super().__new__(cls, value)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)


def ranked_logprobs(top: dict[int, float], num_top: int) -> dict[int, Logprob]:
    """A step's {token id: logprob} as the ranks send it (its num_top most likely first, highest first,
    then the sampled or prompt token where it is below them) as Logprob values: ranks 1..num_top, None
    for the token after them (its rank is not computed)."""
    return {t: Logprob(v, i + 1 if i < num_top else None) for i, (t, v) in enumerate(top.items())}


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None   # where asked: None for the first token
