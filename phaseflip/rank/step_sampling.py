"""A decode step that ends in sampled token ids: the LM head and the sampler inside the recorded step.

Owns: the variants a decode bucket records on a rank that samples from the whole vocabulary
(`sampling_variants`), one per set of sampling paths a batch needs: "greedy" (head + argmax, nothing
more), "plain" (+ temperature/min-p rows), "filtered" (+ top-k/top-p rows), "sampled" (both): head +
`draw.draw_in_step`, each row by its own mode, temperature, top-k, top-p, min-p and the uniform its
generator gave the host before the step; which one a step replays (`variant_for`, from the host-built
columns); and how chunked replays' outputs join (`cat_outputs`). A step's output is (picked, logits):
picked = [2, rows] int64, the ids and whether each row's draw fitted its candidates, read by the host
with one copy; logits stay on the device for the rare full-sort redraw and for logprobs
(sampler.finish_in_step).
On CUDA each variant is one graph, so a decode step is one launch and one wait; on the CPU the same
functions run in the recorded (eager or compiled) step.
"""
from __future__ import annotations

from typing import Callable

import torch

from phaseflip.rank.draw import FILTERED, PLAIN, RowParams, draw_in_step

Step = Callable[[dict[str, torch.Tensor]], torch.Tensor]


VARIANTS = {"greedy": (False, False), "plain": (True, False), "filtered": (False, True), "sampled": (True, True)}


def sampling_variants(step: Step, head: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Step]:
    """The decode step's variants around `step` (hidden states of every row) and `head` (rows -> logits)."""
    def variant(plain: bool, filtered: bool) -> Step:
        def run(meta: dict[str, torch.Tensor]):
            logits = head(step(meta))   # a decode: one row per sequence, each samples
            if not (plain or filtered):   # reads no sampling input: what a step sampled on the host replays
                ids = logits.argmax(dim=-1)
                return torch.stack([ids, torch.ones_like(ids)]), logits
            ids, fits = draw_in_step(logits, meta["sample_mode"], RowParams.from_columns(meta), meta["uniform"][:, None],
                                     plain, filtered)
            return torch.stack([ids, fits.long()]), logits
        return run
    return {name: variant(*paths) for name, paths in VARIANTS.items()}


def variant_for(columns: dict[str, torch.Tensor]) -> str:
    """The variant with exactly the paths these rows take (the host built the columns: no device read;
    none: every row greedy)."""
    if not columns:
        return "greedy"
    mode = columns["sample_mode"]
    paths = (bool((mode == PLAIN).any()), bool((mode == FILTERED).any()))
    return next(name for name, p in VARIANTS.items() if p == paths)


def cat_outputs(parts: list, rows: list[int]):
    """Join chunked replays' outputs, each cut to its chunk's real rows: hidden states, or (picked, logits)."""
    if isinstance(parts[0], torch.Tensor):
        return torch.cat([p[:n] for p, n in zip(parts, rows)])
    picked = torch.cat([p[0][:, :n] for p, n in zip(parts, rows)], dim=1)
    return picked, torch.cat([p[1][:n] for p, n in zip(parts, rows)])
