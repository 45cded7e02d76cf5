"""What the ranks have been told about requests, and what they still must be told (no torch).

Owns: the sequences announced to the ranks (a NewRequest goes with a sequence's first scheduled chunk,
once, preemption or not: the rank keeps its sampling state) and the finished sequences no batch has
carried yet (the rank drops their state when a batch that ran, or an explicit ForgetRequests, says so).
The scheduler composes a batch from these; llm.py tells the ranks directly when no batch follows.
"""
from __future__ import annotations

from phaseflip.engine.requests import Sequence
from phaseflip.rank.messages import NewRequest


def _new_request(seq: Sequence) -> NewRequest:
    """Prompt tokens travel only where the repetition penalty reads them (not every prompt to every rank)."""
    prompt = tuple(seq.prompt_token_ids) if seq.params.needs_prompt_tokens else ()
    return NewRequest(seq_id=seq.seq_id, params=seq.params, num_prompt_tokens=seq.num_prompt_tokens,
                      prompt_token_ids=prompt)


class RankNotices:
    def __init__(self) -> None:
        self._announced: set[int] = set()    # seq ids already sent as NewRequest
        self._finished: list[int] = []       # finished since the last batch that ran

    def announce(self, seqs: list[Sequence]) -> tuple[NewRequest, ...]:
        """NewRequests for those of seqs the ranks have not heard of yet (now they have)."""
        fresh = [s for s in seqs if s.seq_id not in self._announced]
        self._announced.update(s.seq_id for s in fresh)
        return tuple(_new_request(s) for s in fresh)

    def finished(self, seq_id: int) -> None:
        self._announced.discard(seq_id)
        self._finished.append(seq_id)

    def pending_finished(self) -> tuple[int, ...]:
        """Finished sequences the ranks have not been told about yet."""
        return tuple(self._finished)

    def told(self, seq_ids) -> None:
        """The ranks were told that these sequences finished (a batch carrying them ran, or directly)."""
        told = set(seq_ids)
        self._finished = [i for i in self._finished if i not in told]

    def counts(self) -> dict[str, int]:
        return {"announced": len(self._announced), "unreported_finished": len(self._finished)}
