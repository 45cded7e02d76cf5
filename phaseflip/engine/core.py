"""EngineCore: the step loop — schedule, execute, apply sampled tokens, finish what stopped.

Owns: driving the scheduler and the ranks step by step (a step goes to every rank in the active layout;
the output rank's reply carries the sampled tokens) and the per-request timing stamps. It holds no model
state (the ranks do) and knows no API shapes (engine/llm.py does).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from phaseflip.engine.policy.rules import StepSummary
from phaseflip.engine.requests import Sequence, ranked_logprobs
from phaseflip.engine.scheduler import Scheduler
from phaseflip.engine.stopping import check_stop
from phaseflip.rank.messages import RunStep, StepBatch, StepResult


MAX_IDLE_POLLS = 10_000  # a rule that leaves work pending with nothing runnable this long is a bug


@dataclass(frozen=True)
class StepOutcome:
    """What one step did to requests: the sequences that got a token (finished or not, in batch order)
    and those that finished (with or without a new token: the scheduler finishes one that outgrew
    the pool)."""
    sampled: tuple[Sequence, ...] = ()
    finished: tuple[Sequence, ...] = ()


class EngineCore:
    def __init__(self, scheduler: Scheduler, ranks, output_ranks: dict[str, int], control,
                 tokenizer, eos_token_ids: frozenset[int], max_model_len: int):
        self.scheduler = scheduler
        self.ranks, self.output_ranks = ranks, output_ranks   # the rank group; each layout's sampling rank
        self.control = control
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.seqs: dict[int, Sequence] = {}
        self.num_steps = 0
        self._idle_polls = 0

    def execute(self, batch: StepBatch) -> StepResult:
        """Run one step on every rank in the active layout; the output rank's sampled tokens."""
        layout = self.control.active
        replies = self.ranks.call(RunStep(layout, batch))
        reply = replies[self.output_ranks[layout]]
        return StepResult(batch.step_id, reply.sampled or (), reply.prompt_logprobs)

    def add(self, seq: Sequence) -> None:
        self.seqs[seq.seq_id] = seq
        self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> StepOutcome:
        """Run one step: which sequences got a token in it and which finished."""
        prefill, decode = self.control.allowed()
        batch = self.scheduler.schedule(prefill=prefill, decode=decode)
        if batch is None:
            if self.scheduler.has_unfinished():
                self._idle_polls += 1
                if self._idle_polls > MAX_IDLE_POLLS:
                    raise RuntimeError(f"no step could run for {MAX_IDLE_POLLS} polls in a row with work "
                                       f"pending (engine bug); decisions: {self.control.last_decisions()}")
                self.control.on_idle()  # the work may be for the other layout
            return StepOutcome()
        self._idle_polls = 0
        # The scheduler itself finishes a sequence that outgrew the whole KV pool ("length").
        finished = [self.seqs.pop(i) for i in batch.finished_seq_ids
                    if i in self.seqs and self.seqs[i].is_finished]
        t0 = time.perf_counter()
        result = self.execute(batch)
        now = time.perf_counter()
        decodes = sum(1 for c in batch.chunks if c.decode)
        sampled = {s.seq_id: s.token_id for s in result.sampled}
        for part in result.prompt_logprobs:
            self._record_prompt(part)
        self.scheduler.on_step_done(batch, sampled)
        self.num_steps += 1
        advanced = []
        for s in result.sampled:
            seq = self.seqs[s.seq_id]
            advanced.append(seq)
            self._record(seq, s, now)
            decision = check_stop(seq, self.tokenizer, self.eos_token_ids, self.max_model_len)
            if decision is not None:
                seq.stop_reason = decision.stop_reason
                self.scheduler.finish(seq, decision.finish_reason)
                finished.append(self.seqs.pop(seq.seq_id))
        self.control.after_step(StepSummary(
            prefill_tokens=batch.num_tokens - decodes, decode_tokens=decodes, seconds=now - t0,
            finished_output_lengths=tuple(s.num_output_tokens for s in finished)))
        return StepOutcome(tuple(advanced), tuple(finished))

    @staticmethod
    def _record(seq: Sequence, s, now: float) -> None:
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.token_times.append(now - seq.arrival_time)
        if seq.params.logprobs is not None:
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(ranked_logprobs(s.top_logprobs or {s.token_id: s.logprob}, seq.params.logprobs))

    def _record_prompt(self, part) -> None:
        """A chunk's prompt logprobs into its sequence's (by position: a chunk computed again after a
        preemption writes the same values again)."""
        seq = self.seqs.get(part.seq_id)
        if seq is None or seq.prompt_logprobs is None:   # [None] * prompt tokens where asked (LLM.submit)
            return
        n = seq.params.prompt_logprobs
        seq.prompt_logprobs[part.start_pos + 1:part.start_pos + 1 + len(part.logprobs)] = \
            [ranked_logprobs(d, n) for d in part.logprobs]

    def abort(self, seq_ids) -> None:
        """Finish these sequences now ("abort"): their KV blocks are free for the next step, and the
        ranks drop their state with the next batch. Finished or unknown ids are ignored."""
        for seq_id in seq_ids:
            seq = self.seqs.pop(seq_id, None)
            if seq is not None and not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def abort_all(self) -> None:
        self.scheduler.abort_all()
        self.seqs.clear()
