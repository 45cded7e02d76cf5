"""Micro-batches of a pipeline-parallel step: the step's tokens cut into pieces that follow each
other through the stages, so that stage k computes piece i + 1 while stage k + 1 computes piece i.

Owns: where a step is cut (`piece_sizes`, `split_step`). Without pieces a PP step keeps one stage busy at
a time; with M pieces over S stages it takes (M + S - 1) / (M S) of that time, less what each extra
send and step costs. A sequence's chunk may be cut anywhere: a later piece of it attends to the KV an
earlier piece wrote on the same stage, as a chunked prefill does, and only the piece that reaches the
chunk's end samples. Every rank cuts the same step the same way (a pure function of the batch).
"""
from __future__ import annotations

from phaseflip.rank.messages import Phase, SeqChunk, StepBatch

# The smallest piece per device and phase (None: never cut). A piece is worth cutting where its products
# are bound by arithmetic, not by reading the stage's weights, which every piece reads again: on the CPU a
# 16-row product is (docs/performance.md, "Two ranks with PP micro-batches"); on a GPU a decode step is a
# read of the weights (cut, it would cost a read per piece) and a prefill piece needs some hundreds of
# rows (not measured there yet: 512 is a guess until it is).
MIN_PIECE = {"cpu": {Phase.PREFILL: 128, Phase.DECODE: 16}, "cuda": {Phase.PREFILL: 512, Phase.DECODE: None}}
# Pieces fill whole buckets: engine/boot.py's prefill steps of 32 tokens, decode batches of 8 from 24 up.
PIECE_ALIGN = {Phase.PREFILL: 32, Phase.DECODE: 8}


def piece_sizes(phase: Phase, num_tokens: int, pieces: int, device: str = "cpu") -> list[int]:
    """Token counts of the pieces a step of num_tokens is cut into on `device` ("cpu" or "cuda"): at most
    `pieces` of them, each a multiple of the phase's PIECE_ALIGN and at least its MIN_PIECE, except the
    last, which takes the rest."""
    least = MIN_PIECE["cuda" if device.startswith("cuda") else "cpu"][phase]
    if least is None:
        return [num_tokens]
    per, align = -(-num_tokens // max(pieces, 1)), PIECE_ALIGN[phase]
    per = max(least, -(-per // align) * align)
    sizes = [per] * (num_tokens // per)
    if num_tokens % per:
        sizes.append(num_tokens % per)
    return sizes


def split_step(batch: StepBatch, sizes: list[int]) -> list[StepBatch]:
    """The batch as consecutive steps of sizes[i] tokens each, in chunk order; a chunk that straddles a
    cut becomes two chunks of the same sequence. The batch's notices (new requests, finished ids) go with
    the first piece."""
    assert sum(sizes) == batch.num_tokens, (sizes, batch.num_tokens)
    pieces, current, room = [], [], sizes[0]
    for chunk in batch.chunks:
        taken = 0
        while taken < chunk.num_tokens:
            n = min(room, chunk.num_tokens - taken)
            current.append(_part(chunk, taken, n))
            taken, room = taken + n, room - n
            if room == 0:
                pieces.append(current)
                current = []
                room = sizes[len(pieces)] if len(pieces) < len(sizes) else 0
    return [StepBatch(batch.step_id, batch.phase, tuple(chunks),
                      batch.new_requests if i == 0 else (), batch.finished_seq_ids if i == 0 else ())
            for i, chunks in enumerate(pieces)]


def _part(chunk: SeqChunk, a: int, n: int) -> SeqChunk:
    """Tokens a..a+n-1 of the chunk; it samples only if it reaches the chunk's end."""
    if a == 0 and n == chunk.num_tokens:
        return chunk
    end = a + n == chunk.num_tokens
    return SeqChunk(chunk.seq_id, chunk.token_ids[a:a + n], chunk.start_pos + a, chunk.block_ids,
                    sample=chunk.sample and end, decode=chunk.decode)
