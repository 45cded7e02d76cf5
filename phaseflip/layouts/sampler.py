"""The sampler of the output rank: logits of the sampled positions in, one token per sequence out.

Owns: the per-sequence sampling state kept on the output rank between steps (a sequence's
SamplingParams and its own torch.Generator), and the maths that turns a row of logits into a token
(greedy, temperature, top-k, top-p, min-p, logprobs). It never schedules, never decides when a sequence
stops (the controller does, from the tokens it gets back) and never runs the model.

Reproducibility: every sequence has its own CPU torch.Generator and takes one float64 uniform from it
per sampled step (inverse-CDF sampling), and the path a row takes depends only on the row itself. So a
seeded sequence gets the same tokens whatever else is in the batch and in whatever order, and its
uniforms are the same on CPU and CUDA. A generator is seeded with `params.seed` when given, else with a mix
of the engine seed and the sequence id, so an engine built with the same seed reproduces unseeded
requests as well (given the same seq ids). Greedy sequences have no generator.

Filters apply in this order: temperature, top-k, top-p, min-p, over the tokens ordered by (raw logit
descending, token id ascending), so every tie goes to the lower token id (top_k=1 is exactly greedy).
top-k keeps exactly k tokens; top-p keeps the smallest prefix whose mass (renormalised after top-k)
reaches top_p, and always the top token; min-p drops tokens below min_p * the top token's probability.
Filtered rows look at the top NUM_CANDIDATES tokens only (a top-k, not a sort of the vocabulary) and
fall back to a full sort when what they keep might not fit in them; both give the same answer.

Logprobs are computed from the RAW logits (log_softmax before temperature and the filters), as vLLM V1
does by default: the sampled token's logprob and the top-N as {token_id: logprob}, highest first, plus
the sampled token when it is not among them.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from phaseflip.layouts.plan import NewRequest, SampledToken

NUM_CANDIDATES = 1024  # top tokens a top-k/top-p row looks at before falling back to a full sort
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sequence_seed(engine_seed: int, seq_id: int) -> int:
    """The seed of an unseeded sequence: stable across processes and runs (unlike hash())."""
    return _splitmix64(_splitmix64(engine_seed & _MASK64) ^ (seq_id & _MASK64))


@dataclass
class _SeqState:
    params: object  # SamplingParams
    generator: torch.Generator | None  # CPU; None for greedy sequences


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self._seqs: dict[int, _SeqState] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def add(self, seq_id: int, params) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"seq_id={seq_id} is already in the sampler; remove it before adding it again")
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else sequence_seed(self.seed, seq_id)
            generator = torch.Generator().manual_seed(seed & _MASK64)
        self._seqs[seq_id] = _SeqState(params, generator)

    def add_requests(self, new_requests: Iterable[NewRequest]) -> None:
        for request in new_requests:
            self.add(request.seq_id, request.params)

    def remove(self, seq_id: int) -> None:
        """Forget a finished sequence; unknown ids are ignored (it may never have been sampled here)."""
        self._seqs.pop(seq_id, None)

    def sample(self, logits: torch.Tensor, seq_ids: list[int]) -> list[SampledToken]:
        """logits: [B, V] on any device, any float dtype (upcast to float32); row i is seq_ids[i]."""
        if logits.dim() != 2 or logits.shape[0] != len(seq_ids):
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {len(seq_ids)} seq_ids: "
                             f"expected [num_seqs, vocab_size]")
        states = [self._state(s) for s in seq_ids]
        if not states:
            return []
        logits = logits.float()                                                # [B, V]
        token_ids = _choose_tokens(logits, states)                             # [B]
        logprobs = _logprobs(logits, token_ids, states)
        return [SampledToken(s, t, *lp) for s, t, lp in zip(seq_ids, token_ids.tolist(), logprobs)]

    def _state(self, seq_id: int) -> _SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"seq_id={seq_id} has no sampling state: add() it (from its NewRequest) before "
                           f"sampling it") from None


def _choose_tokens(logits: torch.Tensor, states: list[_SeqState]) -> torch.Tensor:
    """Rows go to one of three paths by their own params only; each path is batched over its rows."""
    greedy, plain, filtered = [], [], []
    for i, st in enumerate(states):
        p = st.params
        (greedy if p.greedy else filtered if p.top_k_enabled or p.top_p < 1 else plain).append(i)
    token_ids = torch.empty(len(states), dtype=torch.long, device=logits.device)
    if greedy:
        token_ids[greedy] = _rows(logits, greedy).argmax(dim=-1)
    for rows, draw in ((plain, _draw_plain), (filtered, _draw_filtered)):
        if rows:
            params = [states[i].params for i in rows]
            uniforms = [torch.rand((), dtype=torch.float64, generator=states[i].generator).item() for i in rows]
            u = torch.tensor(uniforms, dtype=torch.float64, device=logits.device)[:, None]   # [n, 1]
            token_ids[rows] = draw(_rows(logits, rows), params, u)
    return token_ids


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    if len(rows) == x.shape[0]:
        return x
    return x[torch.tensor(rows, device=x.device)]


def _column(params: list, name: str, device: torch.device, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)[:, None]   # [n, 1]


def _search(weights_cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first position whose cumulative weight exceeds u * total; never a zero weight."""
    total = weights_cdf[:, -1:]                                                               # [n, 1]
    target = torch.minimum(u * total, total.nextafter(torch.zeros_like(total)))  # u*total may round up
    return torch.searchsorted(weights_cdf, target, right=True)                                # [n, 1]


def _draw_plain(logits: torch.Tensor, params: list, u: torch.Tensor) -> torch.Tensor:
    """Temperature and min-p only: no ordering needed."""
    probs = (logits / _column(params, "temperature", logits.device)).softmax(dim=-1)       # [n, V]
    if any(p.min_p > 0 for p in params):   # min_p == 0 masks nothing, so skipping it changes no row
        min_p = _column(params, "min_p", logits.device)
        probs.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return _search(probs.cumsum(dim=-1, dtype=torch.float64), u).squeeze(1)


def _draw_filtered(logits: torch.Tensor, params: list, u: torch.Tensor) -> torch.Tensor:
    """Top-k / top-p (/ min-p) over the top NUM_CANDIDATES; rows that may not fit there redo a full sort."""
    vocab_size = logits.shape[1]
    token_ids, fits = _draw_from_top(logits, params, u, min(vocab_size, NUM_CANDIDATES))
    if not bool(fits.all()):
        rows = (~fits).nonzero().squeeze(1).tolist()
        token_ids[rows], _ = _draw_from_top(logits[rows], [params[i] for i in rows], u[rows], vocab_size)
    return token_ids


def _top_tokens(logits: torch.Tensor, num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top `num` logits and ids of each row, ordered by (logit desc, id asc), as a stable sort would."""
    if num == logits.shape[1]:
        return logits.sort(dim=-1, descending=True, stable=True)
    values, ids = logits.topk(num, dim=-1, sorted=False)          # ties at the boundary: any subset
    ids, by_id = ids.sort(dim=-1)
    values, order = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, order)                                                       # [n, num]


def _draw_from_top(logits: torch.Tensor, params: list, u: torch.Tensor, num: int):
    """Draw among the top `num` tokens. fits[i]: row i's kept set is certainly the full sort's."""
    device, vocab_size = logits.device, logits.shape[1]
    full_probs = (logits / _column(params, "temperature", device)).softmax(dim=-1)            # [n, V]
    values, ids = _top_tokens(logits, num)                                                    # [n, C]
    probs = full_probs.gather(1, ids).double()                   # the same values whatever num is
    top_k = torch.tensor([min(p.top_k, vocab_size) if p.top_k_enabled else vocab_size for p in params],
                         device=device)[:, None]                                              # [n, 1]
    keep = torch.arange(num, device=device)[None, :] < top_k
    probs = probs * keep
    mass = probs.cumsum(dim=-1)
    whole = top_k == vocab_size        # no top-k: top-p is relative to the whole distribution (mass 1)
    kept_mass = torch.where(whole, 1.0, mass.gather(1, (top_k - 1).clamp(max=num - 1)))
    top_p = _column(params, "top_p", device, torch.float64)
    keep &= (mass - probs < top_p * kept_mass) | (top_p >= 1)
    keep &= probs >= _column(params, "min_p", device, torch.float64) * probs[:, :1]
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


def _logprobs(logits: torch.Tensor, token_ids: torch.Tensor, states: list[_SeqState]) -> list[tuple]:
    """(logprob, top_logprobs) per row; (None, None) for rows that did not ask."""
    out: list[tuple] = [(None, None)] * len(states)
    rows = [i for i, st in enumerate(states) if st.params.logprobs is not None]
    if not rows:
        return out
    logp = _rows(logits, rows).log_softmax(dim=-1)                                            # [n, V]
    row_tokens = _rows(token_ids, rows)
    sampled = logp.gather(1, row_tokens[:, None]).squeeze(1).tolist()
    num_top = min(max(states[i].params.logprobs for i in rows), logp.shape[1])
    top_values, top_ids = logp.topk(num_top, dim=-1)                          # [n, N], highest first
    top_values, top_ids, row_tokens = top_values.tolist(), top_ids.tolist(), row_tokens.tolist()
    for j, i in enumerate(rows):
        n = states[i].params.logprobs
        top = dict(zip(top_ids[j][:n], top_values[j][:n]))
        top.setdefault(row_tokens[j], sampled[j])
        out[i] = (sampled[j], top)
    return out
