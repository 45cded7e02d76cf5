"""Turn a StepBatch into the flat tensors one step reads (tokens, positions, slots, attention metadata).

Owns: `prepare_inputs`, each role's buckets and their buffer rows (`phase_buckets`), and the static-buffer specs (with their padding sentinels) those tensors are
copied into. Sentinels: token id 0 and position 0 for padding tokens (harmless reads), slot -1 (the KV
store writes nowhere), seq_len 0 for padding sequences (attention skips them; their other metadata is
never read; their query_start_loc entries repeat the last real offset, so offsets never decrease).
"""
from __future__ import annotations

import torch

from phaseflip.graphs.buffers import BufferSpec
from phaseflip.rank.messages import Phase, StepBatch

TOKEN_BUFFERS = ("input_ids", "positions", "slot_mapping")
TOKEN_ROWS = (*TOKEN_BUFFERS, "hidden_in")   # every buffer with a row per token (bucket_rows)
SEQ_BUFFERS = ("block_tables", "seq_lens", "query_start_loc")
# A decode that samples inside its recorded step (draw.draw_in_step): one row per sequence. Padding
# rows are greedy with neutral parameters.
SAMPLING_BUFFERS = ("sample_mode", "temperature", "top_k", "top_p", "min_p", "uniform")


def buffer_specs(max_tokens: int, max_seqs: int, max_blocks_per_seq: int) -> dict[str, BufferSpec]:
    i64 = torch.int64
    return {
        "input_ids": BufferSpec((max_tokens,), i64, 0),
        "positions": BufferSpec((max_tokens,), i64, 0),
        "slot_mapping": BufferSpec((max_tokens,), i64, -1),
        "block_tables": BufferSpec((max_seqs, max_blocks_per_seq), i64, 0),
        "seq_lens": BufferSpec((max_seqs,), i64, 0),
        "query_start_loc": BufferSpec((max_seqs + 1,), i64, 0, pad_with_last=True),
        "sample_mode": BufferSpec((max_seqs,), i64, 0),
        "temperature": BufferSpec((max_seqs,), torch.float64, 1.0),
        "top_k": BufferSpec((max_seqs,), i64, 1),
        "top_p": BufferSpec((max_seqs,), torch.float64, 1.0),
        "min_p": BufferSpec((max_seqs,), torch.float64, 0.0),
        "uniform": BufferSpec((max_seqs,), torch.float64, 0.5),
    }


def bucket_sizes(num_tokens: int, num_seqs: int) -> dict[str, int]:
    """Rows of each buffer a step of `num_tokens` tokens over `num_seqs` sequences reads."""
    sizes = {name: num_tokens for name in TOKEN_BUFFERS}
    sizes.update({"block_tables": num_seqs, "seq_lens": num_seqs, "query_start_loc": num_seqs + 1})
    sizes.update({name: num_seqs for name in SAMPLING_BUFFERS})
    return sizes


def phase_buckets(shapes, phase: Phase) -> list[tuple[int, dict[str, int]]]:
    """Each captured bucket of a role (decode: sequences; prefill: tokens) with its buffer rows;
    shapes: the runner's StepShapes."""
    if phase is Phase.DECODE:
        return [(b, bucket_sizes(b, min(b, shapes.max_num_seqs))) for b in shapes.decode_buckets]
    return [(t, bucket_sizes(t, shapes.max_num_seqs)) for t in shapes.prefill_buckets]


def bucket_rows(sizes: dict[str, int]) -> dict[str, int]:
    """A bucket's buffer rows, with a later PP stage's input hidden states as many as its tokens."""
    return {**sizes, "hidden_in": sizes["input_ids"]}


def decode_rows(meta: dict[str, torch.Tensor], a: int, b: int) -> dict[str, torch.Tensor]:
    """Sequences a..b-1 of a decode step's inputs (one token per sequence) as a step of their own."""
    part = {name: meta[name][a:b] for name in meta if name != "query_start_loc"}
    part["query_start_loc"] = meta["query_start_loc"][a:b + 1] - meta["query_start_loc"][a]
    return part


def prepare_inputs(batch: StepBatch, block_size: int) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Exact-size input tensors for `batch`, and the rows whose hidden state is sampled."""
    ids, pos, slots, starts, sample_rows = [], [], [], [0], []
    for c in batch.chunks:
        bt = c.block_ids
        p = range(c.start_pos, c.context_len)
        ids.extend(c.token_ids)
        pos.extend(p)
        slots.extend(bt[i // block_size] * block_size + i % block_size for i in p)
        starts.append(starts[-1] + c.num_tokens)
        if c.sample:
            sample_rows.append(starts[-1] - 1)
    width = max(len(c.block_ids) for c in batch.chunks)
    tables = [list(c.block_ids) + [0] * (width - len(c.block_ids)) for c in batch.chunks]
    meta = {
        "input_ids": torch.tensor(ids, dtype=torch.int64),
        "positions": torch.tensor(pos, dtype=torch.int64),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64),
        "block_tables": torch.tensor(tables, dtype=torch.int64),
        "seq_lens": torch.tensor([c.context_len for c in batch.chunks], dtype=torch.int64),
        "query_start_loc": torch.tensor(starts, dtype=torch.int64),
    }
    return meta, sample_rows
