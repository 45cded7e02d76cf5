"""Where a PP step is cut into micro-batches (rank/micro_batches.py): sizes, and a cut step that holds
the same tokens at the same positions, samples once per sequence and carries its notices once."""
import pytest

from phaseflip.rank.messages import NewRequest, Phase, SeqChunk, StepBatch
from phaseflip.rank.micro_batches import piece_sizes, split_step


@pytest.mark.parametrize("tokens, pieces, expected", [
    (2048, 4, [512] * 4),
    (300, 4, [128, 128, 44]),      # never below 128 tokens a piece
    (255, 4, [128, 127]),
    (127, 4, [127]),               # too small to cut
    (1000, 1, [1000]),             # pp_micro_batches=1: whole
    (1000, 3, [352, 352, 296]),    # whole prefill buckets of 32
])
def test_prefill_piece_sizes(tokens, pieces, expected):
    assert piece_sizes(Phase.PREFILL, tokens, pieces) == expected


def test_decode_piece_sizes_keep_a_minimum_batch():
    assert piece_sizes(Phase.DECODE, 64, 4) == [16] * 4
    assert piece_sizes(Phase.DECODE, 24, 4) == [16, 8]
    assert piece_sizes(Phase.DECODE, 15, 4) == [15]


def test_cuda_cuts_only_large_prefills():
    """A GPU decode is a read of the weights, which each piece would read again: whole; prefill pieces of
    at least 512 tokens."""
    assert piece_sizes(Phase.DECODE, 64, 4, "cuda") == [64]
    assert piece_sizes(Phase.PREFILL, 2048, 4, "cuda") == [512] * 4
    assert piece_sizes(Phase.PREFILL, 600, 4, "cuda") == [512, 88]


def chunk(seq_id, n, start=0, sample=True, decode=False):
    return SeqChunk(seq_id, tuple(range(100 * seq_id, 100 * seq_id + n)), start, (seq_id, seq_id + 10), sample, decode)


def test_split_step_cuts_chunks_at_token_boundaries():
    batch = StepBatch(7, Phase.PREFILL, (chunk(1, 5, sample=False), chunk(2, 200, start=30), chunk(3, 1, 9, decode=True)),
                      new_requests=(NewRequest(2, None, 230),), finished_seq_ids=(9,))
    pieces = split_step(batch, [128, 78])
    assert [p.num_tokens for p in pieces] == [128, 78]
    flat = [(c.seq_id, t, c.start_pos + i) for p in pieces for c in p.chunks for i, t in enumerate(c.token_ids)]
    whole = [(c.seq_id, t, c.start_pos + i) for c in batch.chunks for i, t in enumerate(c.token_ids)]
    assert flat == whole                                  # the same tokens, at the same positions, in order
    assert [(c.seq_id, c.sample) for p in pieces for c in p.chunks] == [(1, False), (2, False), (2, True), (3, True)]
    assert pieces[0].chunks[1].block_ids == pieces[1].chunks[0].block_ids == (2, 12)
    assert (pieces[0].new_requests, pieces[0].finished_seq_ids) == (batch.new_requests, (9,))
    assert (pieces[1].new_requests, pieces[1].finished_seq_ids) == ((), ())
    assert all(p.step_id == 7 and p.phase is Phase.PREFILL for p in pieces)


def test_split_step_keeps_whole_chunks_whole():
    batch = StepBatch(1, Phase.DECODE, tuple(chunk(i, 1, 50, decode=True) for i in range(32)))
    pieces = split_step(batch, [16, 16])
    assert [c for p in pieces for c in p.chunks] == list(batch.chunks)   # the same objects, none cut
