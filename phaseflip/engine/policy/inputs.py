"""What the layout policy reads, measured from the live engine at the moment of a decision.

Owns: `measure(...) -> PolicyInputs` from the scheduler's queues, the block allocator's free count and
the meters (estimators.py). Capacity figures are exactly what the allocator could deliver (a counter
must never promise what the actuator cannot pay): a waiting prompt counts as admissible only if its
blocks fit beside what the running sequences still need to reach max_tokens. No torch.
"""
from __future__ import annotations

from phaseflip.engine.policy.terms import PolicyInputs
from phaseflip.engine.policy.estimators import Meters
from phaseflip.engine.requests import Sequence
from phaseflip.engine.scheduler import Scheduler


def _max_tokens(seq: Sequence, max_model_len: int) -> int:
    mt = seq.params.max_tokens
    limit = max_model_len - seq.num_prompt_tokens
    return limit if mt is None else min(mt, limit)


def _prefill_left(seq: Sequence) -> int:
    return 0 if Scheduler.wants_decode(seq) else seq.num_tokens - seq.num_computed_tokens


def _walk(waiting, blocks_free: int, slots_free: int, blocks_needed, tokens_of) -> int:
    """Prompt tokens (to compute: tokens_of) of waiting sequences admitted FIFO while slots and blocks
    last (no skipping; a cached prefix still counts its blocks, as the allocator would)."""
    tokens = 0
    for seq in waiting:
        need = blocks_needed(seq.num_tokens)
        if slots_free < 1 or need > blocks_free:
            break
        tokens, blocks_free, slots_free = tokens + tokens_of(seq), blocks_free - need, slots_free - 1
    return tokens


def measure(scheduler: Scheduler, meters: Meters, active: str, now_s: float, max_model_len: int) -> PolicyInputs:
    alloc, cfg = scheduler.allocator, scheduler.config
    running, waiting = scheduler.running, list(scheduler.waiting)
    carried = [s for s in running if Scheduler.wants_decode(s)]
    bundle = sum(max(0, alloc.blocks_needed(s.num_prompt_tokens + _max_tokens(s, max_model_len)) - len(s.block_ids))
                 for s in running)
    running_prefill = sum(_prefill_left(s) for s in running)
    # prefix caching: a waiting prompt's cached prefix is not work; looked up for the sequences the next
    # admissions can take (max_num_seqs), the rest count whole (a lookup per prompt per decision)
    near = cfg.max_num_seqs
    pending = (running_prefill + sum(scheduler.uncached_tokens(s) for s in waiting[:near])
               + sum(s.num_tokens for s in waiting[near:]))
    free = alloc.num_free_blocks
    admissible = running_prefill + _walk(waiting, max(0, free - bundle), cfg.max_num_seqs - len(running),
                                         alloc.blocks_needed, scheduler.uncached_tokens)
    fillable = max(admissible, _walk(waiting, alloc.num_total_blocks, cfg.max_num_seqs, alloc.blocks_needed,
                                     scheduler.uncached_tokens))
    unstarted = [s.arrival_time for s in waiting + running if s.first_token_time is None]
    return PolicyInputs(
        active=active, now_s=now_s, pending_prefill_tokens=pending, admissible_prefill_tokens=admissible,
        fillable_prefill_tokens=min(fillable, pending), num_waiting=len(waiting), num_running=len(running),
        num_carried_decodes=len(carried),
        carried_decode_tokens=sum(meters.outputs.expected_left(s.num_output_tokens, _max_tokens(s, max_model_len))
                                  for s in carried),
        free_kv_blocks=free, bundle_kv_blocks=bundle,
        oldest_wait_s=now_s - min(unstarted) if unstarted else None,
        progress=meters.tracker.snapshot(), rates={k: e.reading() for k, e in meters.rates.items()},
        legs={k: e.reading() for k, e in meters.legs.items()})
