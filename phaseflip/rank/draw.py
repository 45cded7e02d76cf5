"""The draw: rows of logits in, one token per row out, each row by its own path.

Owns: the three paths a row takes (greedy argmax, plain: temperature and min-p, filtered: top-k / top-p
as well), `RowParams` (a batch's parameters as columns), `draw_rows` (the host's draw, each path batched
over its rows) and `draw_in_step` (every path on every row inside a recorded step, each row keeping its
own). Each takes the row's uniform from the caller: the per-sequence state, the uniforms and the logprobs
are sampler.py's.

Filters apply in this order: temperature, top-k, top-p, min-p, over the tokens ordered by (raw logit
descending, token id ascending), so every tie goes to the lower token id (top_k=1 is exactly greedy).
top-k keeps exactly k tokens; top-p keeps the smallest prefix whose mass (renormalised after top-k)
reaches top_p, and always the top token; min-p drops tokens below min_p * the top token's probability.
Filtered rows look at the top NUM_CANDIDATES tokens only (a top-k, not a sort of the vocabulary) and
fall back to a full sort when what they keep might not fit in them; both give the same answer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NUM_CANDIDATES = 1024  # top tokens a top-k/top-p row looks at before falling back to a full sort

GREEDY, PLAIN, FILTERED = 0, 1, 2   # a row's sampling path (the `sample_mode` step input)


def mode_of(params) -> int:
    return GREEDY if params.greedy else FILTERED if params.top_k_enabled or params.top_p < 1 else PLAIN


_ROW_PARAMS = ("temperature", "top_k", "top_p", "min_p")


@dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters as [n, 1] columns on the logits' device (greedy rows hold neutral
    values). The same maths reads them whether the host built them or a recorded step's buffers hold them."""
    temperature: torch.Tensor   # float64
    top_k: torch.Tensor         # int64: min(top_k, vocab) where top-k is on, else the vocabulary size
    top_p: torch.Tensor         # float64
    min_p: torch.Tensor         # float64

    @staticmethod
    def of(params: list, vocab_size: int, device=None) -> RowParams:
        def col(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)[:, None]
        live = [p if not p.greedy else None for p in params]
        return RowParams(col([p.temperature if p else 1.0 for p in live], torch.float64),
                         col([min(p.top_k, vocab_size) if p and p.top_k_enabled else vocab_size for p in live],
                             torch.int64),
                         col([p.top_p if p else 1.0 for p in live], torch.float64),
                         col([p.min_p if p else 0.0 for p in live], torch.float64))

    @staticmethod
    def from_columns(columns: dict[str, torch.Tensor]) -> RowParams:
        """From one-row-per-sequence step inputs ([n] each, as `columns` gives them)."""
        return RowParams(*(columns[name][:, None] for name in _ROW_PARAMS))

    def columns(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name)[:, 0] for name in _ROW_PARAMS}

    def rows(self, index: torch.Tensor) -> RowParams:
        return RowParams(self.temperature[index], self.top_k[index], self.top_p[index], self.min_p[index])


def draw_rows(logits: torch.Tensor, params: list, u: torch.Tensor) -> torch.Tensor:
    """Row i's token by params[i]'s own path (greedy argmax, plain, filtered), each path batched over its
    rows. logits: [n, V] float32; u: [n] float64 on the logits' device, row i's uniform (greedy rows
    ignore it)."""
    paths: dict[int, list[int]] = {GREEDY: [], PLAIN: [], FILTERED: []}
    for i, p in enumerate(params):
        paths[mode_of(p)].append(i)
    token_ids = torch.empty(len(params), dtype=torch.long, device=logits.device)
    if paths[GREEDY]:
        token_ids[paths[GREEDY]] = take_rows(logits, paths[GREEDY]).argmax(dim=-1)
    for rows, draw in ((paths[PLAIN], _draw_plain), (paths[FILTERED], _draw_filtered)):
        if rows:
            cols = RowParams.of([params[i] for i in rows], logits.shape[1], logits.device)
            token_ids[rows] = draw(take_rows(logits, rows), cols, take_rows(u, rows)[:, None])   # u: [n, 1]
    return token_ids


def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    if len(rows) == x.shape[0]:
        return x
    return x[torch.tensor(rows, device=x.device)]


def _search(weights_cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first position whose cumulative weight exceeds u * total; never a zero weight."""
    total = weights_cdf[:, -1:]                                                               # [n, 1]
    target = torch.minimum(u * total, total.nextafter(torch.zeros_like(total)))  # u*total may round up
    return torch.searchsorted(weights_cdf, target, right=True)                                # [n, 1]


def _draw_plain(logits: torch.Tensor, cols: RowParams, u: torch.Tensor) -> torch.Tensor:
    """Temperature and min-p only: no ordering needed (min_p == 0 masks nothing)."""
    probs = (logits / cols.temperature.float()).softmax(dim=-1)                               # [n, V]
    probs.masked_fill_(probs < cols.min_p.float() * probs.amax(dim=-1, keepdim=True), 0.0)
    return _search(probs.cumsum(dim=-1, dtype=torch.float64), u).squeeze(1)


def _draw_filtered(logits: torch.Tensor, cols: RowParams, u: torch.Tensor) -> torch.Tensor:
    """Top-k / top-p (/ min-p) over the top NUM_CANDIDATES; rows that may not fit there redo a full sort."""
    vocab_size = logits.shape[1]
    token_ids, fits = _draw_from_top(logits, cols, u, min(vocab_size, NUM_CANDIDATES))
    if not bool(fits.all()):
        rows = (~fits).nonzero().squeeze(1)
        token_ids[rows], _ = _draw_from_top(logits[rows], cols.rows(rows), u[rows], vocab_size)
    return token_ids


def draw_in_step(logits: torch.Tensor, mode: torch.Tensor, cols: RowParams, u: torch.Tensor,
                 plain: bool = True, filtered: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's token by its own mode, without a host decision (a recorded step, a CUDA graph): each
    path runs on every row and each row keeps its own, so a row gets exactly the token the host path
    would give it. `plain` / `filtered` False leave a path out for a step with no such row (the
    candidates' top-k costs ~1 ms a row on the CPU, the plain path's cumulative sum ~0.3 ms). fits[i]
    False: a filtered row whose kept set may reach past the candidates; the host redoes it with a full
    sort (`Sampler.finish_in_step`)."""
    logits = logits.float()
    ids = logits.argmax(dim=-1)
    fits = torch.ones_like(ids, dtype=torch.bool)
    if plain:
        ids = torch.where(mode == PLAIN, _draw_plain(logits, cols, u), ids)
    if filtered:
        top, top_fits = _draw_from_top(logits, cols, u, min(logits.shape[1], NUM_CANDIDATES))
        ids, fits = torch.where(mode == FILTERED, top, ids), top_fits | (mode != FILTERED)
    return ids, fits


def _top_tokens(logits: torch.Tensor, num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top `num` logits and ids of each row, ordered by (logit desc, id asc), as a stable sort would."""
    if num == logits.shape[1]:
        return logits.sort(dim=-1, descending=True, stable=True)
    values, ids = logits.topk(num, dim=-1, sorted=False)          # ties at the boundary: any subset
    ids, by_id = ids.sort(dim=-1)
    values, order = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, order)                                                       # [n, num]


def _draw_from_top(logits: torch.Tensor, cols: RowParams, u: torch.Tensor, num: int):
    """Draw among the top `num` tokens. fits[i]: row i's kept set is certainly the full sort's."""
    device, vocab_size = logits.device, logits.shape[1]
    full_probs = (logits / cols.temperature.float()).softmax(dim=-1)                          # [n, V]
    values, ids = _top_tokens(logits, num)                                                    # [n, C]
    probs = full_probs.gather(1, ids).double()                   # the same values whatever num is
    top_k = cols.top_k                                                                        # [n, 1]
    keep = torch.arange(num, device=device)[None, :] < top_k
    probs = probs * keep
    mass = probs.cumsum(dim=-1)
    whole = top_k == vocab_size        # no top-k: top-p is relative to the whole distribution (mass 1)
    kept_mass = torch.where(whole, 1.0, mass.gather(1, (top_k - 1).clamp(max=num - 1)))
    top_p = cols.top_p
    keep &= (mass - probs < top_p * kept_mass) | (top_p >= 1)
    keep &= probs >= cols.min_p * probs[:, :1]
    keep = keep.byte().cummin(dim=-1).values.bool()  # a prefix, even if exp() is not monotone to the ulp
    num_kept = keep.sum(dim=-1, keepdim=True)
    positions = _search((probs * keep).cumsum(dim=-1), u)                                     # [n, 1]
    token_ids = ids.gather(1, positions).squeeze(1)
    if num == vocab_size:
        return token_ids, torch.ones_like(token_ids, dtype=torch.bool)
    # A kept set ending above the smallest candidate holds every token of its values (no tie is cut).
    last_kept = values.gather(1, num_kept - 1)
    fits = (whole | (top_k <= num) | (top_p >= 1)) & (last_kept > values[:, -1:])
    return token_ids, fits.squeeze(1)
