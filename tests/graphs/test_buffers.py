"""StaticBuffers: allocated once, filled by prefix + sentinel padding, never reallocated."""
import pytest
import torch

from phaseflip.graphs.buffers import BufferSpec, StaticBuffers
from phaseflip.rank.step_inputs import buffer_specs, bucket_sizes

I64 = torch.int64


def _buffers() -> StaticBuffers:
    return StaticBuffers({
        "ids": BufferSpec((8,), I64, 0),
        "slots": BufferSpec((8,), I64, -1),
        "tables": BufferSpec((4, 5), I64, 0),
    })


def _ptrs(b: StaticBuffers) -> dict[str, int]:
    return {name: t.data_ptr() for name, t in b.tensors.items()}


def test_allocated_full_size_with_the_sentinel():
    b = _buffers()
    assert b.tensors["ids"].shape == (8,) and b.tensors["tables"].shape == (4, 5)
    assert (b.tensors["slots"] == -1).all() and (b.tensors["ids"] == 0).all()
    assert all(t.dtype == I64 for t in b.tensors.values())
    assert b.num_bytes == (8 + 8 + 20) * 8


def test_addresses_never_change_across_fills_and_views():
    b = _buffers()
    before = _ptrs(b)
    views = b.views({"ids": 4, "slots": 4, "tables": 2})
    for n, rows in [(3, 4), (8, 8), (1, 2), (0, 8), (5, 5)]:
        b.fill("ids", torch.arange(n, dtype=I64) + 1, rows)
        b.fill("slots", torch.arange(n, dtype=I64) + 100, rows)
        b.fill("tables", torch.ones(min(n, 4), 3, dtype=I64), min(rows, 4))
        assert _ptrs(b) == before
    # views are prefixes of the same storage: they see every fill
    assert {k: v.data_ptr() for k, v in views.items()} == before
    b.fill("ids", torch.tensor([7, 8, 9], dtype=I64), 4)
    assert views["ids"].tolist() == [7, 8, 9, 0]


def test_views_are_leading_prefixes_full_when_absent():
    b = _buffers()
    v = b.views({"ids": 3, "tables": 2})
    assert v["ids"].shape == (3,) and v["tables"].shape == (2, 5) and v["slots"].shape == (8,)
    assert all(v[k].data_ptr() == b.tensors[k].data_ptr() for k in v)


def test_fill_copies_the_prefix_and_pads_the_bucket_tail():
    b = _buffers()
    b.fill("slots", torch.arange(8, dtype=I64) + 10, 8)          # dirty every row first
    b.fill("slots", torch.tensor([5, 6, 7], dtype=I64), 6)
    # rows [0, 3): the data; [3, 6): the sentinel; [6, 8): outside the bucket, left as they were
    assert b.tensors["slots"].tolist() == [5, 6, 7, -1, -1, -1, 16, 17]
    b.fill("ids", torch.arange(8, dtype=I64) + 10, 8)
    b.fill("ids", torch.tensor([1], dtype=I64), 8)
    assert b.tensors["ids"].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]


def test_fill_of_nothing_pads_the_whole_bucket():
    b = _buffers()
    b.fill("slots", torch.arange(8, dtype=I64), 8)
    b.fill("slots", torch.empty(0, dtype=I64), 4)
    assert b.tensors["slots"].tolist() == [-1, -1, -1, -1, 4, 5, 6, 7]


def test_fill_refuses_more_rows_than_the_bucket():
    b = _buffers()
    with pytest.raises(ValueError, match=r"buffer 'ids': 5 rows do not fit a bucket of 4"):
        b.fill("ids", torch.arange(5, dtype=I64), 4)
    assert (b.tensors["ids"] == 0).all(), "a refused fill must not write anything"


def test_fill_refuses_a_bucket_larger_than_the_buffer():
    b = _buffers()
    with pytest.raises(ValueError, match=r"buffer 'ids': 3 rows do not fit a bucket of 9 \(buffer holds 8\)"):
        b.fill("ids", torch.arange(3, dtype=I64), 9)


def test_2d_fill_writes_leading_columns_and_pads_rows():
    b = _buffers()
    b.fill("tables", torch.full((4, 5), 9, dtype=I64), 4)           # dirty everything
    b.fill("tables", torch.tensor([[1, 2], [3, 4]], dtype=I64), 3)
    t = b.tensors["tables"]
    assert t[:2, :2].tolist() == [[1, 2], [3, 4]]
    assert (t[:2, 2:] == 9).all(), "columns past the live width are documented as left alone"
    assert (t[2] == 0).all(), "the bucket's padding row is all sentinel"
    assert (t[3] == 9).all(), "rows past the bucket are untouched"


def test_2d_fill_refuses_too_many_columns_with_a_clear_message():
    b = StaticBuffers({"tables": BufferSpec((4, 3), I64, 0)})
    with pytest.raises(ValueError, match="tables"):
        b.fill("tables", torch.ones(2, 5, dtype=I64), 4)


def test_step_input_specs_declare_the_documented_sentinels():
    specs = buffer_specs(max_tokens=64, max_seqs=4, max_blocks_per_seq=6)
    assert specs["slot_mapping"].pad_value == -1           # the KV store writes nowhere
    assert specs["seq_lens"].pad_value == 0                # attention skips padding sequences
    assert specs["input_ids"].pad_value == 0 and specs["positions"].pad_value == 0
    assert specs["block_tables"].shape == (4, 6) and specs["query_start_loc"].shape == (5,)
    sizes = bucket_sizes(num_tokens=32, num_seqs=3)
    b = StaticBuffers(specs)
    views = b.views(sizes)
    assert views["input_ids"].shape == (32,) and views["slot_mapping"].shape == (32,)
    assert views["seq_lens"].shape == (3,) and views["query_start_loc"].shape == (4,)
    assert views["block_tables"].shape == (3, 6)


def test_staged_buffers_show_a_fill_after_one_upload_of_the_whole_mirror():
    """What CUDA runs (staged=True by default there): the int64 buffers are views of one flat tensor,
    written through a host mirror and moved by one copy per step; other dtypes are filled in place."""
    specs = {"ids": BufferSpec((8,), I64, 0), "tables": BufferSpec((4, 5), I64, 0),
             "hidden": BufferSpec((8, 2), torch.float32, 0)}
    b = StaticBuffers(specs, staged=True)
    before = _ptrs(b)
    assert b.tensors["tables"].data_ptr() == b.tensors["ids"].data_ptr() + 8 * 8, "one flat tensor"
    b.fill("ids", torch.tensor([4, 5], dtype=I64), 4)
    b.fill("tables", torch.tensor([[1, 2]], dtype=I64), 2)
    b.fill("hidden", torch.ones(3, 2), 4)
    assert (b.tensors["ids"] == 0).all() and (b.tensors["tables"] == 0).all(), "visible before upload"
    assert b.tensors["hidden"][:3].eq(1).all(), "a float buffer is not staged"
    b.upload()
    assert b.uploads == 1 and _ptrs(b) == before
    assert b.tensors["ids"].tolist() == [4, 5, 0, 0, 0, 0, 0, 0]
    assert b.tensors["tables"][:2].tolist() == [[1, 2, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert not StaticBuffers(specs).staged, "the CPU fills its buffers in place unless asked"
