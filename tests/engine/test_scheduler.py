"""Scheduler: chunked prefill under a token budget, FIFO admission, decode detection, preemption by
recompute (checked end to end against a fake model that reads its context back from a paged KV store)."""
import random
import subprocess
import sys

import pytest

from phaseflip.engine.blocks import BlockAllocator
from phaseflip.engine.sampling_params import SamplingParams
from phaseflip.engine.requests import Sequence, SeqStatus
from phaseflip.engine.scheduler import Scheduler, SchedulerConfig
from phaseflip.rank.messages import Phase


def make_sched(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_prefill_chunk=16):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_prefill_chunk=max_prefill_chunk, block_size=block_size)
    return Scheduler(config, BlockAllocator(num_blocks, block_size))


def make_seq(seq_id, num_prompt_tokens, max_tokens=4):
    prompt = [1000 * (seq_id + 1) + i for i in range(num_prompt_tokens)]
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", prompt_token_ids=prompt,
                    params=SamplingParams(max_tokens=max_tokens))


def step(sched, plan, token=7):
    """Complete a plan, sampling `token` for every sampled chunk."""
    sched.on_step_done(plan, {c.seq_id: token for c in plan.chunks if c.sample})


def chunk_of(plan, seq_id):
    (chunk,) = [c for c in plan.chunks if c.seq_id == seq_id]
    return chunk


# -- config ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk", "block_size"])
@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_config_rejects_bad_values_naming_field_and_value(field, bad):
    kwargs = dict(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=16, block_size=4)
    kwargs[field] = bad
    with pytest.raises(ValueError, match=field) as err:
        SchedulerConfig(**kwargs)
    assert repr(bad) in str(err.value)


def test_config_is_frozen():
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1, max_prefill_chunk=1, block_size=1)
    with pytest.raises(Exception):
        config.max_num_seqs = 2


def test_block_size_must_match_the_allocator():
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_prefill_chunk=8, block_size=16)
    with pytest.raises(ValueError, match="16.*8"):
        Scheduler(config, BlockAllocator(num_blocks=4, block_size=8))


# -- add ---------------------------------------------------------------------------------------------

def test_add_refuses_a_prompt_larger_than_the_whole_pool_naming_both_numbers():
    sched = make_sched(num_blocks=3, block_size=4)
    with pytest.raises(ValueError, match=r"4 KV blocks.*only 3"):
        sched.add(make_seq(0, 13))
    assert sched.num_waiting == 0 and not sched.has_unfinished()
    sched.add(make_seq(1, 12))  # exactly the pool: accepted
    assert sched.num_waiting == 1


def test_add_refuses_duplicates_and_empty_prompts():
    sched = make_sched()
    seq = make_seq(0, 3)
    sched.add(seq)
    with pytest.raises(ValueError, match="already added"):
        sched.add(make_seq(0, 3))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add(make_seq(1, 0))


def test_queue_counts():
    sched = make_sched()
    assert not sched.has_unfinished() and sched.num_waiting == 0 and sched.num_running == 0
    sched.add(make_seq(0, 3))
    sched.add(make_seq(1, 3))
    assert sched.has_unfinished() and sched.num_waiting == 2
    sched.schedule()
    assert sched.num_waiting == 0 and sched.num_running == 2


def test_schedule_returns_none_without_work():
    assert make_sched().schedule() is None


# -- chunked prefill, budget, sampling, phases ---------------------------------------------------------

def test_chunked_prefill_respects_max_prefill_chunk_and_samples_only_at_the_end():
    sched = make_sched(max_prefill_chunk=4, block_size=4)
    seq = make_seq(0, 10)
    sched.add(seq)
    sizes, starts, samples = [], [], []
    for _ in range(3):
        plan = sched.schedule()
        chunk = chunk_of(plan, 0)
        assert plan.phase is Phase.PREFILL
        assert chunk.token_ids == tuple(seq.prompt_token_ids[chunk.start_pos:chunk.context_len])
        assert len(chunk.block_ids) * 4 >= chunk.context_len
        assert chunk.block_ids == tuple(seq.block_ids)
        sizes.append(chunk.num_tokens), starts.append(chunk.start_pos), samples.append(chunk.sample)
        step(sched, plan, token=55)
    assert sizes == [4, 4, 2] and starts == [0, 4, 8] and samples == [False, False, True]
    assert seq.num_computed_tokens == 10 and seq.output_token_ids == [55]
    plan = sched.schedule()  # now a decode of the sampled token
    chunk = chunk_of(plan, 0)
    assert plan.phase is Phase.DECODE
    assert chunk.token_ids == (55,) and chunk.start_pos == 10 and chunk.sample
    assert seq.block_ids == [0, 1, 2]


def test_token_budget_limits_a_step():
    sched = make_sched(max_num_batched_tokens=6, max_prefill_chunk=8)
    a, b = make_seq(0, 10), make_seq(1, 10)
    sched.add(a), sched.add(b)
    plan = sched.schedule()
    assert [(c.seq_id, c.num_tokens) for c in plan.chunks] == [(0, 6)]
    assert sched.num_running == 1 and sched.num_waiting == 1  # no budget left: b not admitted
    step(sched, plan)
    plan = sched.schedule()
    assert [(c.seq_id, c.num_tokens) for c in plan.chunks] == [(0, 4), (1, 2)]
    assert plan.num_tokens == 6


def test_budget_is_shared_by_decodes_and_prefill_with_decodes_first():
    sched = make_sched(max_num_batched_tokens=8, max_prefill_chunk=8)
    for i in range(3):
        sched.add(make_seq(i, 2))
    step(sched, sched.schedule())  # three 2-token prompts, all sampled
    sched.add(make_seq(3, 20))
    plan = sched.schedule()
    assert [(c.seq_id, c.num_tokens) for c in plan.chunks] == [(0, 1), (1, 1), (2, 1), (3, 5)]
    assert plan.phase is Phase.PREFILL
    assert [c.sample for c in plan.chunks] == [True, True, True, False]


def test_chunk_order_puts_decodes_before_prefills_even_when_admitted_later():
    sched = make_sched(max_num_batched_tokens=64, max_prefill_chunk=4)
    sched.add(make_seq(0, 12))   # long prefill, admitted first
    sched.add(make_seq(1, 2))    # short, decoding from step 2
    step(sched, sched.schedule())
    plan = sched.schedule()
    assert [c.seq_id for c in plan.chunks] == [1, 0]
    assert chunk_of(plan, 1).num_tokens == 1 and chunk_of(plan, 0).num_tokens == 4


def test_one_token_prompt_is_prefill_not_decode():
    sched = make_sched()
    sched.add(make_seq(0, 1))
    plan = sched.schedule()
    assert plan.chunks[0].num_tokens == 1 and plan.chunks[0].sample
    assert plan.phase is Phase.PREFILL


def test_all_decode_step_is_decode_phase():
    sched = make_sched()
    for i in range(4):
        sched.add(make_seq(i, 3 + i))
    step(sched, sched.schedule())
    for _ in range(3):
        plan = sched.schedule()
        assert plan.phase is Phase.DECODE and plan.num_seqs == 4
        assert all(c.num_tokens == 1 and c.sample for c in plan.chunks)
        step(sched, plan)


def test_max_num_seqs_is_respected():
    sched = make_sched(max_num_seqs=2)
    seqs = [make_seq(i, 3) for i in range(3)]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()
    assert [c.seq_id for c in plan.chunks] == [0, 1] and sched.num_running == 2
    step(sched, plan)
    plan = sched.schedule()
    assert [c.seq_id for c in plan.chunks] == [0, 1]
    step(sched, plan)
    sched.finish(seqs[0], "stop")
    plan = sched.schedule()
    assert [c.seq_id for c in plan.chunks] == [1, 2]


def test_fifo_admission_never_skips_ahead():
    sched = make_sched(num_blocks=5, block_size=4, max_prefill_chunk=16)
    a = make_seq(0, 8)            # 2 blocks
    sched.add(a)
    step(sched, sched.schedule())  # a now has 9 tokens: its decode needs a 3rd block
    sched.add(make_seq(1, 12))    # head: needs 3 blocks for its first chunk, 2 are free after a's decode
    sched.add(make_seq(2, 4))     # would fit (1 block) but must not jump the queue
    plan = sched.schedule()
    assert [c.seq_id for c in plan.chunks] == [0]
    assert [s.seq_id for s in sched.waiting] == [1, 2]
    assert sched.allocator.num_free_blocks == 2


def test_fifo_admission_admits_in_arrival_order():
    sched = make_sched(max_num_seqs=8, max_prefill_chunk=4)
    for i in [5, 3, 9, 1]:
        sched.add(make_seq(i, 2))
    plan = sched.schedule()
    assert [c.seq_id for c in plan.chunks] == [5, 3, 9, 1]
    assert [s.seq_id for s in sched.running] == [5, 3, 9, 1]


# -- new requests and finished ids ---------------------------------------------------------------------

def test_new_requests_are_sent_once():
    sched = make_sched(max_prefill_chunk=2)
    params = SamplingParams(max_tokens=3)
    seq = Sequence(seq_id=4, request_id="x", prompt_token_ids=[1, 2, 3], params=params)
    sched.add(seq)
    plan = sched.schedule()
    (req,) = plan.new_requests
    assert req.seq_id == 4 and req.params is params and req.num_prompt_tokens == 3
    step(sched, plan)
    for _ in range(3):
        plan = sched.schedule()
        assert plan.new_requests == ()
        step(sched, plan)


def test_finished_ids_are_reported_once_in_the_next_plan():
    sched = make_sched()
    a, b = make_seq(0, 3), make_seq(1, 3)
    sched.add(a), sched.add(b)
    plan = sched.schedule()
    assert plan.finished_seq_ids == ()
    step(sched, plan)
    sched.finish(a, "stop")
    assert a.status is SeqStatus.FINISHED and a.finish_reason == "stop" and a.block_ids == []
    sched.finish(a, "length")  # already finished: left as is
    assert a.finish_reason == "stop"
    plan = sched.schedule()
    assert plan.finished_seq_ids == (0,) and [c.seq_id for c in plan.chunks] == [1]
    step(sched, plan)
    plan = sched.schedule()
    assert plan.finished_seq_ids == ()


def test_finish_a_waiting_sequence():
    sched = make_sched(max_num_seqs=1)
    a, b = make_seq(0, 3), make_seq(1, 3)
    sched.add(a), sched.add(b)
    step(sched, sched.schedule())
    sched.finish(b, "abort")
    assert sched.num_waiting == 0 and b.is_finished
    assert sched.schedule().finished_seq_ids == (1,)


def test_finish_frees_blocks_and_steps_ids_increase():
    sched = make_sched(num_blocks=8, block_size=4)
    seq = make_seq(0, 9)
    sched.add(seq)
    plan1 = sched.schedule()
    assert sched.allocator.num_free_blocks == 5
    step(sched, plan1)
    plan2 = sched.schedule()
    assert plan2.step_id == plan1.step_id + 1
    step(sched, plan2)
    sched.finish(seq, "length")
    assert sched.allocator.num_free_blocks == 8 and not sched.has_unfinished()


def test_abort_all_clears_everything_and_frees_blocks():
    sched = make_sched(num_blocks=16, max_num_seqs=2)
    seqs = [make_seq(i, 5) for i in range(4)]
    for s in seqs:
        sched.add(s)
    sched.schedule()  # left in flight on purpose
    aborted = sched.abort_all()
    assert [s.seq_id for s in aborted] == [0, 1, 2, 3]
    assert all(s.is_finished and s.finish_reason == "abort" for s in seqs)
    assert not sched.has_unfinished() and sched.allocator.num_free_blocks == 16
    assert sched.schedule() is None  # nothing in flight any more, nothing to run


# -- on_step_done --------------------------------------------------------------------------------------

def test_on_step_done_needs_every_sampled_token_and_changes_nothing_otherwise():
    sched = make_sched()
    a, b = make_seq(0, 3), make_seq(1, 3)
    sched.add(a), sched.add(b)
    plan = sched.schedule()
    with pytest.raises(KeyError, match="seq 1"):
        sched.on_step_done(plan, {0: 5})
    assert a.num_computed_tokens == 0 and a.output_token_ids == []
    sched.on_step_done(plan, {0: 5, 1: 6})
    assert a.output_token_ids == [5] and b.output_token_ids == [6]
    assert a.num_computed_tokens == 3 and a.num_tokens == 4


def test_one_plan_in_flight_at_a_time():
    sched = make_sched()
    sched.add(make_seq(0, 3))
    plan = sched.schedule()
    with pytest.raises(RuntimeError, match="in flight"):
        sched.schedule()
    step(sched, plan)
    with pytest.raises(RuntimeError, match="not the step in flight"):
        step(sched, plan)


def test_on_step_done_skips_sequences_finished_during_the_step():
    sched = make_sched()
    a, b = make_seq(0, 3), make_seq(1, 3)
    sched.add(a), sched.add(b)
    plan = sched.schedule()
    sched.finish(a, "abort")
    sched.on_step_done(plan, {1: 9})
    assert a.output_token_ids == [] and b.output_token_ids == [9]


# -- preemption ----------------------------------------------------------------------------------------

def fill_two_decoders(num_blocks=4):
    """Two 4-token prompts in a pool of `num_blocks` 4-token blocks, both prefilled and sampled."""
    sched = make_sched(num_blocks=num_blocks, block_size=4)
    a, b = make_seq(0, 4), make_seq(1, 4)
    sched.add(a), sched.add(b)
    step(sched, sched.schedule(), token=11)
    return sched, a, b


def test_preempts_the_latest_admitted_when_blocks_run_out():
    sched, a, b = fill_two_decoders(num_blocks=3)
    sched.add(make_seq(2, 1))
    plan = sched.schedule()  # a takes the last free block; b has none left -> b preempts itself
    assert [c.seq_id for c in plan.chunks] == [0]
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert b.num_preemptions == 1 and sched.num_preemptions == 1 and a.num_preemptions == 0
    assert [s.seq_id for s in sched.waiting] == [1, 2]  # front of the queue; nothing admitted this step
    assert sched.allocator.num_free_blocks == 1
    assert b.output_token_ids == [11]  # outputs survive preemption


def test_no_admission_in_a_step_that_preempted():
    sched = make_sched(num_blocks=3, block_size=4, max_prefill_chunk=4)
    a, b = make_seq(0, 4), make_seq(1, 4)
    sched.add(a), sched.add(b)
    step(sched, sched.schedule())
    plan = sched.schedule()  # b preempts itself; its 4-token first chunk would fit the freed block
    assert [c.seq_id for c in plan.chunks] == [0]
    assert sched.allocator.num_free_blocks == 1 and [s.seq_id for s in sched.waiting] == [1]
    step(sched, plan)
    plan = sched.schedule()  # next step: b is re-admitted first in the queue
    assert [c.seq_id for c in plan.chunks] == [0, 1]
    assert chunk_of(plan, 1).token_ids == tuple(b.prompt_token_ids)


def test_preempts_a_later_sequence_to_make_room_for_an_earlier_one():
    sched = make_sched(num_blocks=4, block_size=4, max_prefill_chunk=16)
    a, b = make_seq(0, 8), make_seq(1, 8)
    sched.add(a), sched.add(b)
    step(sched, sched.schedule())  # a and b hold 2 blocks each; pool full
    plan = sched.schedule()  # a needs a 3rd block: b (latest, unscheduled) is preempted
    assert [c.seq_id for c in plan.chunks] == [0]
    assert b.status is SeqStatus.WAITING and b.num_preemptions == 1 and a.num_preemptions == 0
    assert len(a.block_ids) == 3


def test_several_preemptions_keep_admission_order_in_the_queue():
    sched = make_sched(num_blocks=4, block_size=4)
    seqs = [make_seq(i, 4) for i in range(4)]
    for s in seqs:
        sched.add(s)
    step(sched, sched.schedule())  # four full blocks, four decodes pending
    plan = sched.schedule()  # 0 needs a block: 3 preempted; 1 needs one: 2 preempted
    assert [c.seq_id for c in plan.chunks] == [0, 1]
    assert [s.seq_id for s in sched.waiting] == [2, 3]
    assert sched.num_preemptions == 2


def test_preempted_sequence_recomputes_prompt_and_outputs_and_is_not_new_again():
    sched, a, b = fill_two_decoders(num_blocks=3)
    plan = sched.schedule()
    assert b.status is SeqStatus.WAITING
    step(sched, plan, token=12)  # a decodes
    sched.finish(a, "stop")
    plan = sched.schedule()
    chunk = chunk_of(plan, 1)
    assert chunk.start_pos == 0 and chunk.token_ids == tuple(b.prompt_token_ids) + (11,)
    assert chunk.sample and plan.phase is Phase.PREFILL
    assert plan.new_requests == ()  # the rank kept b's sampling state
    assert plan.finished_seq_ids == (0,)
    step(sched, plan, token=13)
    assert b.output_token_ids == [11, 13] and b.num_computed_tokens == 5


def test_sequence_outgrowing_the_pool_finishes_with_length_instead_of_wedging():
    sched = make_sched(num_blocks=2, block_size=4)
    seq = make_seq(0, 7)
    sched.add(seq)
    step(sched, sched.schedule())  # 8 tokens: the pool's capacity
    plan = sched.schedule()
    step(sched, plan)  # decode of token 8 fits; samples token 9
    assert seq.num_tokens == 9
    assert sched.schedule() is None  # token 9 can never be cached
    assert seq.is_finished and seq.finish_reason == "length"
    assert sched.allocator.num_free_blocks == 2 and not sched.has_unfinished()


# -- end to end: a fake model over a paged KV store ----------------------------------------------------

class FakeModel:
    """Writes each chunk's tokens into a paged store through the block table and samples a token that
    depends on the whole context READ BACK from the store, so wrong tables or missing recompute show."""

    def __init__(self, block_size):
        self.block_size = block_size
        self.kv = {}  # (block id, slot) -> (seq id, token)

    def run(self, plan):
        owners = [b for c in plan.chunks for b in c.block_ids]
        assert len(owners) == len(set(owners)), "two sequences share a block"
        sampled = {}
        for c in plan.chunks:
            assert len(c.block_ids) * self.block_size >= c.context_len
            for j, tok in enumerate(c.token_ids):
                self.kv[self._slot(c, c.start_pos + j)] = (c.seq_id, tok)
            if c.sample:
                context = [self.kv[self._slot(c, p)] for p in range(c.context_len)]
                assert all(owner == c.seq_id for owner, _ in context), "read another sequence's KV"
                sampled[c.seq_id] = next_token([tok for _, tok in context])
        return sampled

    def _slot(self, chunk, pos):
        return chunk.block_ids[pos // self.block_size], pos % self.block_size


def next_token(context):
    return sum((i + 1) * t for i, t in enumerate(context)) * 2654435761 % 50_000


def run_to_completion(sched, seqs, max_steps=100_000):
    """Drive the scheduler like the engine does; returns per-seq streams and what the plans reported."""
    by_id = {s.seq_id: s for s in seqs}
    model = FakeModel(sched.config.block_size)
    announced, finished_reported, phases = [], [], set()
    for s in seqs:
        sched.add(s)
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        assert plan is not None, "work left but nothing scheduled: a wedge"
        assert plan.num_tokens <= sched.config.max_num_batched_tokens
        assert plan.num_seqs <= sched.config.max_num_seqs
        assert all(c.num_tokens <= sched.config.max_prefill_chunk for c in plan.chunks)
        announced += [r.seq_id for r in plan.new_requests]
        finished_reported += plan.finished_seq_ids
        phases.add(plan.phase)
        sched.on_step_done(plan, model.run(plan))
        for c in plan.chunks:
            seq = by_id[c.seq_id]
            if c.sample and seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
        held = sum(len(s.block_ids) for s in seqs)
        assert sched.allocator.num_free_blocks + held == sched.allocator.num_total_blocks
    else:
        pytest.fail("did not finish")
    while (plan := sched.schedule()) is not None:  # pragma: no cover - nothing left to run
        pytest.fail("a plan after all work finished")
    return {s.seq_id: list(s.output_token_ids) for s in seqs}, announced, finished_reported, phases


def random_seqs(seed, n=12):
    rng = random.Random(seed)
    return [make_seq(i, rng.randint(1, 20), max_tokens=rng.randint(1, 15)) for i in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_tiny_pool_preempts_and_yields_the_same_streams_as_a_big_pool(seed):
    big = make_sched(num_blocks=1000, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                     max_prefill_chunk=8)
    expected, _, _, _ = run_to_completion(big, random_seqs(seed))
    assert big.num_preemptions == 0

    tiny = make_sched(num_blocks=10, block_size=4, max_num_seqs=6, max_num_batched_tokens=16,
                      max_prefill_chunk=8)
    seqs = random_seqs(seed)
    streams, announced, finished_reported, phases = run_to_completion(tiny, seqs)
    assert tiny.num_preemptions > 0 and any(s.num_preemptions for s in seqs)
    assert streams == expected
    assert all(s.is_finished and s.finish_reason == "length" for s in seqs)
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert sorted(announced) == [s.seq_id for s in seqs]  # once each, preemption or not
    assert len(finished_reported) == len(set(finished_reported))
    assert tiny.allocator.num_free_blocks == tiny.allocator.num_total_blocks
    assert phases == {Phase.PREFILL, Phase.DECODE}


def test_finished_ids_reach_a_plan_exactly_once_each():
    sched = make_sched(num_blocks=1000, max_num_seqs=3)
    seqs = random_seqs(7, n=10)
    seqs.append(make_seq(99, 3, max_tokens=40))  # still running when all the others are done
    _, _, finished_reported, _ = run_to_completion(sched, seqs)
    assert sorted(finished_reported) == sorted(s.seq_id for s in seqs if s.seq_id != 99)


def test_scheduler_imports_no_torch():
    code = ("import sys, phaseflip.engine.scheduler, phaseflip.engine.blocks; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- sliding windows ---------------------------------------------------------------------------------

def windowed(num_blocks: int, max_prefill_chunk: int, window: int) -> tuple[Scheduler, BlockAllocator]:
    """A scheduler of blocks of 4 whose every layer has a sliding window of `window`, and its allocator."""
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_prefill_chunk=max_prefill_chunk,
                             block_size=4, window=window)
    alloc = BlockAllocator(num_blocks, 4)
    return Scheduler(config, alloc), alloc


def test_blocks_behind_every_layers_window_are_given_back_once():
    """window 6, blocks of 4: position p needs p - 5 on, so block b is dropped once the next query is at
    4 (b + 1) + 5 or later; the table keeps its entries, the pool gets the blocks, release frees the rest."""
    sched, alloc = windowed(num_blocks=16, max_prefill_chunk=4, window=6)
    seq = make_seq(0, 10, max_tokens=12)
    sched.add(seq)
    held = []
    while seq.status is not SeqStatus.FINISHED:
        plan = sched.schedule()
        chunk = chunk_of(plan, 0)
        assert len(chunk.block_ids) * 4 >= chunk.context_len   # the table still covers every position
        held.append(16 - alloc.num_free_blocks)
        step(sched, plan)
        if seq.num_output_tokens == 12:
            sched.finish(seq, "length")
    assert seq.num_computed_tokens == 21 and sched.num_window_freed_blocks == 3   # blocks 0-2 (query at 20 sees 15 on)
    assert max(held) <= 3 and alloc.num_free_blocks == 16


def test_preempting_a_sequence_that_dropped_blocks_frees_only_what_it_holds():
    sched, alloc = windowed(num_blocks=8, max_prefill_chunk=16, window=4)
    seq = make_seq(0, 16, max_tokens=8)
    sched.add(seq)
    step(sched, sched.schedule())
    step(sched, sched.schedule())                  # the decode at 16 sees 13 on: blocks 0-2 dropped
    assert seq.num_dropped_blocks == 3 and alloc.num_free_blocks == 8 - 2
    sched._preempt(seq)
    assert alloc.num_free_blocks == 8 and seq.block_ids == [] and seq.num_dropped_blocks == 0


def test_a_windowed_sequence_longer_than_the_pool_runs_to_its_end():
    """window 6, chunks of 4, blocks of 4: a sequence holds at most blocks_needed(6 - 1 + 4) + 1 = 4
    blocks at once, so a pool of 4 serves a 20-token prompt (5 blocks) and 20 new tokens (10 blocks in
    all); without the window the same pool refuses that prompt, and one that fits ends at the pool."""
    sched, alloc = windowed(num_blocks=4, max_prefill_chunk=4, window=6)
    seq = make_seq(0, 20, max_tokens=20)
    sched.add(seq)
    while seq.status is not SeqStatus.FINISHED:
        step(sched, sched.schedule())
        assert alloc.num_free_blocks >= 0
        if seq.num_output_tokens == 20:
            sched.finish(seq, "length")
    assert seq.num_output_tokens == 20 and seq.num_computed_tokens == 39 and alloc.num_free_blocks == 4
    plain = make_sched(num_blocks=4, block_size=4, max_prefill_chunk=4)
    with pytest.raises(ValueError, match="needs 5 KV blocks at once but the pool has only 4"):
        plain.add(make_seq(1, 20))
    short = make_seq(2, 10, max_tokens=20)
    plain.add(short)
    while (plan := plain.schedule()) is not None:
        step(plain, plan)
    assert short.status is SeqStatus.FINISHED and short.num_tokens == 17   # 16 positions in 4 blocks + the last


def test_a_windowed_sequence_admitted_on_a_long_cached_prefix_drops_what_is_behind_its_window():
    """A cached prefix of 3 blocks, a pool of 4: the reused blocks behind the first query's window go
    back at admission, as a running sequence's do before each step (_most_blocks counts on it)."""
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_prefill_chunk=4, block_size=4,
                             window=6)
    alloc = BlockAllocator(4, 4, prefix_caching=True)
    sched = Scheduler(config, alloc)
    first = make_seq(0, 16, max_tokens=1)
    sched.add(first)
    while first.num_output_tokens < 1:
        step(sched, sched.schedule())
    sched.finish(first, "length")
    second = Sequence(seq_id=1, request_id="r1", prompt_token_ids=first.prompt_token_ids[:13] + [5, 6, 7, 8],
                      params=SamplingParams(max_tokens=2))
    sched.add(second)
    plan = sched.schedule()
    assert plan is not None and chunk_of(plan, 1).num_tokens > 0
    assert alloc.cache_stats()["hit_blocks"] == 3 and second.num_dropped_blocks >= 1


def test_a_full_attention_layer_keeps_every_block():
    sched = make_sched(num_blocks=16, block_size=4, max_prefill_chunk=4)   # window 0: the default
    seq = make_seq(0, 12, max_tokens=8)
    sched.add(seq)
    for _ in range(8):
        step(sched, sched.schedule())
    assert sched.num_window_freed_blocks == 0 and seq.num_dropped_blocks == 0
