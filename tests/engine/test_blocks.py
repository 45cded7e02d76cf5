"""BlockAllocator: accounting, all-or-nothing allocation, deterministic order, double-free detection."""
import random

import pytest

from phaseflip.engine.blocks import BlockAllocator
from phaseflip.engine.sampling_params import SamplingParams
from phaseflip.engine.requests import Sequence


def make_seq(seq_id=0, num_prompt_tokens=1):
    return Sequence(seq_id=seq_id, request_id=str(seq_id), prompt_token_ids=list(range(num_prompt_tokens)),
                    params=SamplingParams())


@pytest.mark.parametrize("kwargs, name, shown", [
    (dict(num_blocks=0, block_size=16), "num_blocks", "0"),
    (dict(num_blocks=-3, block_size=16), "num_blocks", "-3"),
    (dict(num_blocks=4, block_size=0), "block_size", "0"),
    (dict(num_blocks=4, block_size=2.0), "block_size", "2.0"),
    (dict(num_blocks=True, block_size=16), "num_blocks", "True"),
])
def test_rejects_bad_arguments_naming_the_value(kwargs, name, shown):
    with pytest.raises(ValueError, match=name) as err:
        BlockAllocator(**kwargs)
    assert shown in str(err.value)


def test_initial_accounting():
    alloc = BlockAllocator(num_blocks=7, block_size=16)
    assert alloc.num_total_blocks == 7
    assert alloc.num_free_blocks == 7
    assert alloc.num_used_blocks == 0
    assert alloc.block_size == 16


def test_allocate_and_free_accounting():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    a = alloc.allocate(3)
    b = alloc.allocate(5)
    assert len(a) == 3 and len(b) == 5
    assert sorted(a + b) == list(range(8))
    assert alloc.num_free_blocks == 0 and alloc.num_used_blocks == 8
    alloc.free(a)
    assert alloc.num_free_blocks == 3 and alloc.num_used_blocks == 5
    alloc.free(b)
    assert alloc.num_free_blocks == 8 and alloc.num_used_blocks == 0


def test_allocation_order_is_deterministic_and_freed_ids_are_reused_first():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    assert alloc.allocate(3) == [0, 1, 2]
    alloc.free([1, 0])
    assert alloc.allocate(3) == [1, 0, 3]


def test_allocate_zero_returns_nothing():
    alloc = BlockAllocator(num_blocks=2, block_size=4)
    assert alloc.allocate(0) == []
    assert alloc.num_free_blocks == 2


def test_allocate_too_many_raises_and_allocates_nothing():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    alloc.allocate(3)
    with pytest.raises(RuntimeError, match="cannot allocate 2 KV blocks: only 1 of 4"):
        alloc.allocate(2)
    assert alloc.num_free_blocks == 1
    assert alloc.allocate(1) == [3]


def test_allocate_negative_is_an_error():
    alloc = BlockAllocator(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="-1"):
        alloc.allocate(-1)
    assert not alloc.can_allocate(-1)


def test_can_allocate_is_exactly_what_allocate_delivers():
    alloc = BlockAllocator(num_blocks=5, block_size=4)
    alloc.allocate(2)
    for k in range(0, 7):
        promised = alloc.can_allocate(k)
        try:
            ids = alloc.allocate(k)
        except RuntimeError:
            delivered = False
        else:
            delivered = True
            alloc.free(ids)
        assert promised == delivered, k
        assert promised == (k <= alloc.num_free_blocks)


def test_double_free_is_an_error_and_frees_nothing():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    ids = alloc.allocate(2)
    alloc.free(ids[:1])
    with pytest.raises(ValueError, match="double free"):
        alloc.free(ids)  # ids[0] already free; ids[1] must stay allocated
    assert alloc.num_free_blocks == 3
    alloc.free(ids[1:])
    assert alloc.num_free_blocks == 4


def test_duplicate_ids_in_one_free_are_an_error():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    ids = alloc.allocate(2)
    with pytest.raises(ValueError, match="twice"):
        alloc.free([ids[0], ids[0]])
    assert alloc.num_free_blocks == 2


@pytest.mark.parametrize("foreign", [4, -1, 99])
def test_freeing_a_foreign_id_is_an_error(foreign):
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    alloc.allocate(4)
    with pytest.raises(ValueError, match=str(foreign)):
        alloc.free([foreign])
    assert alloc.num_free_blocks == 0


def test_freeing_a_never_allocated_id_is_an_error():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([0])
    assert alloc.num_free_blocks == 4


@pytest.mark.parametrize("num_tokens, expected", [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_needed_is_ceil_division(num_tokens, expected):
    assert BlockAllocator(num_blocks=1, block_size=4).blocks_needed(num_tokens) == expected


def test_blocks_needed_rejects_negative():
    with pytest.raises(ValueError, match="-2"):
        BlockAllocator(num_blocks=1, block_size=4).blocks_needed(-2)


def test_ensure_capacity_grows_the_block_table():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    seq = make_seq()
    assert alloc.ensure_capacity(seq, 5)
    assert seq.block_ids == [0, 1]
    assert alloc.ensure_capacity(seq, 8)  # already covered: no new block
    assert seq.block_ids == [0, 1] and alloc.num_free_blocks == 2
    assert alloc.ensure_capacity(seq, 9)
    assert seq.block_ids == [0, 1, 2] and alloc.num_free_blocks == 1


def test_ensure_capacity_is_all_or_nothing():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    seq = make_seq()
    assert alloc.ensure_capacity(seq, 4)
    assert not alloc.ensure_capacity(seq, 4 * 5)  # needs 4 more, 3 free
    assert seq.block_ids == [0]
    assert alloc.num_free_blocks == 3
    assert alloc.ensure_capacity(seq, 16)
    assert alloc.num_free_blocks == 0


def test_release_frees_the_table():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    seq = make_seq()
    alloc.ensure_capacity(seq, 10)
    alloc.release(seq)
    assert seq.block_ids == [] and alloc.num_free_blocks == 4
    alloc.release(seq)  # empty table: nothing to free
    assert alloc.num_free_blocks == 4


def test_random_alloc_free_keeps_accounting_exact():
    rng = random.Random(0)
    alloc = BlockAllocator(num_blocks=32, block_size=8)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            k = rng.randrange(0, 6)
            if alloc.can_allocate(k):
                held.append(alloc.allocate(k))
            else:
                with pytest.raises(RuntimeError):
                    alloc.allocate(k)
        flat = [b for ids in held for b in ids]
        assert len(flat) == len(set(flat))
        assert alloc.num_free_blocks + len(flat) == alloc.num_total_blocks
        assert alloc.num_used_blocks == len(flat)
