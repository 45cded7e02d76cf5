"""Continuous batching over paged KV: forms the next StepBatch from the waiting and running sequences.

Owns: the FIFO waiting queue, the running list (in admission order), preemption by recompute and the
bookkeeping after a step (num_computed_tokens, sampled tokens). What the ranks are told about requests
(new and finished ones, carried by each batch) is engine/rank_notices.py's. It decides WHAT runs in a
step; which layout runs it is the layout policy's (engine/policy/).

One step (vLLM-V1 style, a single token budget `max_num_batched_tokens`):
  1. Running sequences, in admission order, each take their next tokens: 1 when only the last sampled
     token is uncomputed (a decode), else a prefill chunk of min(remaining, budget left,
     max_prefill_chunk). When the pool cannot cover a sequence's chunk, the most recently admitted
     running sequence not yet scheduled this step is preempted (recompute; possibly the sequence
     itself) and the sequence retries.
  2. If nothing was preempted, waiting sequences are admitted FIFO (head-of-line: never skip ahead)
     while a slot, budget and blocks for their first chunk are available. With prefix caching a
     sequence starts on the cached blocks of its longest cached prefix (engine/prefix_cache.py):
     they count as computed, and its first chunk starts after them. After each step, the full
     blocks a step completed are entered in the cache.
Chunk order in the batch: decodes first, then prefill chunks; each group in admission order.

A sequence whose next chunk needs more blocks than the whole pool holds can never run: it is finished
with reason "length" (the pool is its max model length) instead of wedging the scheduler. Where every
layer attends a sliding window, a sequence gives back the blocks wholly behind its next query's window
before it is scheduled or admitted (their table entries stay, never read again), so it holds at most its
chunk and one window of blocks at once, whatever its length.

Must never: import torch, or promise tokens the allocator cannot deliver.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields

from phaseflip.engine.blocks import BlockAllocator
from phaseflip.engine.rank_notices import RankNotices
from phaseflip.engine.requests import Sequence, SeqStatus
from phaseflip.rank.messages import Phase, SeqChunk, StepBatch


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int             # running sequences (decode slots)
    max_num_batched_tokens: int   # token budget of one step
    max_prefill_chunk: int        # tokens of one sequence's prefill chunk
    block_size: int               # tokens per KV block; must equal the allocator's
    window: int = 0               # every layer's sliding window is at least this (0: a layer attends all)

    def __post_init__(self) -> None:
        for f in fields(self):
            value, least = getattr(self, f.name), 0 if f.name == "window" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"SchedulerConfig.{f.name} must be an int >= {least}, got {value!r}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator) -> None:
        if config.block_size != allocator.block_size:
            raise ValueError(f"SchedulerConfig.block_size={config.block_size} != "
                             f"allocator block_size={allocator.block_size}")
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []           # admission order
        self.num_preemptions = 0                    # total, over all sequences
        self.num_window_freed_blocks = 0            # blocks given back from behind the sliding window
        self._step_id = 0
        self.notices = RankNotices()                # new and finished requests, for the ranks
        self._live: dict[int, Sequence] = {}        # waiting + running, by seq_id
        self._in_flight: int | None = None          # step_id of the batch awaiting on_step_done

    # -- queue state ---------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (FIFO). Refuses one whose prompt alone needs more blocks at once than the
        whole KV pool holds."""
        if seq.seq_id in self._live:
            raise ValueError(f"seq_id {seq.seq_id} was already added")
        if seq.num_prompt_tokens < 1:
            raise ValueError(f"seq {seq.seq_id} has an empty prompt")
        if seq.status is not SeqStatus.WAITING or seq.num_computed_tokens or seq.block_ids:
            raise ValueError(f"seq {seq.seq_id} is not fresh: status={seq.status.value}, "
                             f"num_computed_tokens={seq.num_computed_tokens}, blocks={seq.block_ids}")
        num_blocks = self._most_blocks(seq.num_prompt_tokens)
        if num_blocks > self.allocator.num_total_blocks:
            raise ValueError(f"seq {seq.seq_id}: its prompt of {seq.num_prompt_tokens} tokens needs "
                             f"{num_blocks} KV blocks at once but the pool has only "
                             f"{self.allocator.num_total_blocks} in total")
        self.waiting.append(seq)
        self._live[seq.seq_id] = seq

    # -- one step ------------------------------------------------------------------------------
    def schedule(self, prefill: bool = True, decode: bool = True) -> StepBatch | None:
        """The next step's batch, or None when there is nothing to run. One batch in flight at a time.

        prefill=False leaves prompt chunks (and admission) out; decode=False leaves decodes out: the
        layout rule uses them to run prefill in one layout and decode in the other."""
        if self._in_flight is not None:
            raise RuntimeError(f"step {self._in_flight} is still in flight: call on_step_done first")
        budget = self.config.max_num_batched_tokens
        scheduled, budget, preempted = self._schedule_running(budget, prefill, decode)
        if not preempted and prefill:
            scheduled += self._admit_waiting(budget)
        if not scheduled:
            return None
        chunks = [self._make_chunk(seq, n) for seq, n in scheduled]
        ordered = [c for c in chunks if c.decode] + [c for c in chunks if not c.decode]
        self._step_id += 1
        batch = StepBatch(step_id=self._step_id, phase=Phase.DECODE if all(c.decode for c in chunks) else Phase.PREFILL,
                        chunks=tuple(ordered), new_requests=self.notices.announce([seq for seq, _ in scheduled]),
                        finished_seq_ids=self.notices.pending_finished())
        self._in_flight = batch.step_id
        return batch

    def _schedule_running(self, budget: int, prefill: bool = True,
                          decode: bool = True) -> tuple[list[tuple[Sequence, int]], int, bool]:
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._exceeds_pool(seq):
                self.finish(seq, "length")
                continue
            if not (decode if self.wants_decode(seq) else prefill):
                i += 1
                continue
            self._drop_behind_window(seq)
            n = self._num_next_tokens(seq, budget)
            while not self.allocator.ensure_capacity(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]  # latest admitted; everything before index i is scheduled
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
        return scheduled, budget, preempted

    def _admit_waiting(self, budget: int) -> list[tuple[Sequence, int]]:
        admitted: list[tuple[Sequence, int]] = []
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if self._exceeds_pool(seq):
                self.finish(seq, "length")
                continue
            cache, hits = self.allocator.cache, self._reuse_prefix(seq)
            if cache is not None and cache.computed_elsewhere(seq, hits):
                self._drop_blocks(seq)
                break  # its next block is being computed: reuse it a step later (head-of-line)
            self._drop_behind_window(seq)   # reused blocks behind its first query's window go back
            n = self._num_next_tokens(seq, budget)
            if not self.allocator.ensure_capacity(seq, seq.num_computed_tokens + n):
                self._drop_blocks(seq)
                break  # head-of-line: never skip ahead
            if cache is not None:
                cache.admit(seq, hits)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            admitted.append((seq, n))
            budget -= n
        return admitted

    def _reuse_prefix(self, seq: Sequence) -> int:
        """With prefix caching, start seq on the cached blocks of its longest cached prefix: they count
        as computed. Returns how many blocks it reused."""
        cache = self.allocator.cache
        if cache is None or seq.params.prompt_logprobs is not None:   # its prompt's logprobs need every row
            return 0
        hits = cache.match(seq)
        self.allocator.share(hits)
        seq.block_ids, seq.num_cached_blocks = list(hits), len(hits)
        seq.num_computed_tokens = len(hits) * self.config.block_size
        return len(hits)

    def uncached_tokens(self, seq: Sequence) -> int:
        """Tokens a waiting seq would compute if admitted now (all of them without prefix caching)."""
        cache = self.allocator.cache
        if cache is None or seq.params.prompt_logprobs is not None:
            return seq.num_tokens
        return seq.num_tokens - len(cache.match(seq)) * self.config.block_size

    def _drop_blocks(self, seq: Sequence) -> None:
        """seq gives back every block and every computed token (preemption, a failed admission)."""
        self.allocator.release(seq)
        seq.num_computed_tokens = 0

    def _drop_behind_window(self, seq: Sequence) -> None:
        """Where every layer has a sliding window, give back seq's blocks that lie wholly before the window
        of its next query (position num_computed_tokens sees num_computed_tokens - window + 1 on)."""
        if self.config.window:
            oldest = max(0, seq.num_computed_tokens - self.config.window + 1)
            self.num_window_freed_blocks += self.allocator.drop_leading(seq, oldest // self.config.block_size)

    def _num_next_tokens(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed_tokens
        return min(remaining, budget, self.config.max_prefill_chunk)

    def _exceeds_pool(self, seq: Sequence) -> bool:
        """The blocks seq holds at once with all its tokens (the last sampled one included) must fit in KV
        before it can go on."""
        return self._most_blocks(seq.num_tokens) > self.allocator.num_total_blocks

    def max_sequence_tokens(self) -> int | None:
        """The most tokens one sequence can have in this pool: every block's, or None (no bound but the
        model's length) where every layer's sliding window lets the pool hold its longest step."""
        if self.config.window and self._most_blocks(2**62) <= self.allocator.num_total_blocks:
            return None
        return self.allocator.num_total_blocks * self.config.block_size

    def _most_blocks(self, num_tokens: int) -> int:
        """The most KV blocks a sequence of num_tokens holds at once: all of them; where every layer has a
        sliding window, at most those of its longest step's chunk (max_prefill_chunk tokens) and the
        window before its first query, plus a block for their alignment (_drop_behind_window)."""
        every = self.allocator.blocks_needed(num_tokens)
        if not self.config.window:
            return every
        return min(every, self.allocator.blocks_needed(self.config.window - 1 + self.config.max_prefill_chunk) + 1)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, requeue at the front; prompt + outputs are prefilled again."""
        self.running.remove(seq)
        self._drop_blocks(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _make_chunk(self, seq: Sequence, n: int) -> SeqChunk:
        start = seq.num_computed_tokens
        return SeqChunk(seq_id=seq.seq_id, token_ids=tuple(seq.tokens_slice(start, start + n)),
                        start_pos=start, block_ids=tuple(seq.block_ids),
                        sample=start + n == seq.num_tokens, decode=self.wants_decode(seq))

    @staticmethod
    def wants_decode(seq: Sequence) -> bool:
        """seq's next step is a decode: everything but its last (generated) token is in the cache."""
        return seq.num_computed_tokens == seq.num_tokens - 1 and seq.num_output_tokens > 0

    # -- after a step ----------------------------------------------------------------------------
    def on_step_done(self, batch: StepBatch, sampled_token_ids: dict[int, int]) -> None:
        """Advance every chunk's sequence; append the sampled token of chunks with sample=True.

        Chunks of sequences finished (aborted) since the batch was made are skipped. Everything is
        checked before anything changes.
        """
        if batch.step_id != self._in_flight:
            raise RuntimeError(f"step {batch.step_id} is not the step in flight ({self._in_flight})")
        live = [(c, self._live[c.seq_id]) for c in batch.chunks if c.seq_id in self._live]
        for chunk, seq in live:
            if seq.num_computed_tokens != chunk.start_pos:
                raise RuntimeError(f"step {batch.step_id} is stale for seq {seq.seq_id}: chunk starts at "
                                   f"{chunk.start_pos}, seq has {seq.num_computed_tokens} computed")
            if chunk.sample and chunk.seq_id not in sampled_token_ids:
                raise KeyError(f"step {batch.step_id}: no sampled token for seq {seq.seq_id}")
        self._in_flight = None
        self.notices.told(batch.finished_seq_ids)  # only once the batch ran: an interrupted batch's go again
        cache = self.allocator.cache
        for chunk, seq in live:
            seq.num_computed_tokens += chunk.num_tokens
            if chunk.sample:
                seq.output_token_ids.append(sampled_token_ids[chunk.seq_id])
            if cache is not None:
                cache.enter(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark seq finished, free its blocks, drop it from the queues. A finished seq is left as is."""
        if seq.status is SeqStatus.FINISHED:
            return
        if self._live.pop(seq.seq_id, None) is None:
            raise ValueError(f"seq {seq.seq_id} is not scheduled here")
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.allocator.release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.notices.finished(seq.seq_id)

    def live_state(self) -> dict[str, int]:
        """Counts of every piece of per-request state held here: all 0 when no request is left."""
        return {"waiting": len(self.waiting), "running": len(self.running), "live": len(self._live),
                **self.notices.counts(), "in_flight": int(self._in_flight is not None)}

    def abort_all(self, reason: str = "abort") -> list[Sequence]:
        """Finish every waiting and running sequence; returns them (running first, admission order)."""
        seqs = list(self.running) + list(self.waiting)
        for seq in seqs:
            self.finish(seq, reason)
        self._in_flight = None
        return seqs
