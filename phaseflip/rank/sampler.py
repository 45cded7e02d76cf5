"""The sampler of the output rank: logits of the sampled positions in, one token per sequence out.

Owns: the per-sequence sampling state kept on the output rank between steps (a sequence's
SamplingParams, its own torch.Generator and, where its params ask for penalties or a logit bias, its
penalties.SeqPenalties), and the maths that turns a row of logits into a token (greedy, temperature,
top-k, top-p, min-p, logprobs). It never schedules, never decides when a sequence stops (the controller
does, from the tokens it gets back) and never runs the model.

Reproducibility: every sequence has its own CPU torch.Generator and takes one float64 uniform from it
per sampled step (inverse-CDF sampling), and the path a row takes depends only on the row itself. So a
seeded sequence gets the same tokens whatever else is in the batch and in whatever order, and its
uniforms are the same on CPU and CUDA. A generator is seeded with `params.seed` when given, else with
a mix of the engine seed and the sequence id, so an engine built with the same seed reproduces
unseeded requests as well (given the same seq ids). Greedy sequences have no generator. A decode step
that samples inside its recorded step (step_sampling.py) takes the same uniform from the same
generator before the step, and `draw_in_step` runs the same maths on every row, each row keeping its
own path: the same tokens.

Penalties and logit bias (penalties.py: bias, then repetition, frequency, presence, as vLLM V1) change
the logits a row is drawn from, greedy rows included, before temperature and the filters. Both entry
points draw through one function, `draw_rows` (each row by its mode, given its logits, params and
uniform): `sample` on the adjusted logits; a recorded step does not apply penalties, so
`finish_in_step` redraws the rows that ask for them on the host from the step's logits, adjusted, with
the uniform the step was given. A penalized seeded sequence gets the same tokens on either path. The
token chosen is then counted in the sequence's output counts.

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

from phaseflip.rank.penalties import SeqPenalties, adjusted_logits, record_tokens
from phaseflip.rank.messages import NewRequest, SampledToken

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
    penalties: SeqPenalties | None     # None where the params adjust no logit
    prompt: tuple[int, ...] = ()       # where the params read it (repetition penalty, prompt logprobs)


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self._seqs: dict[int, _SeqState] = {}
        self.in_step_finishes = 0   # decode steps whose tokens were drawn inside the recorded step

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def add(self, seq_id: int, params, prompt_token_ids: tuple[int, ...] = ()) -> None:
        """prompt_token_ids: read by the repetition penalty and the prompt's logprobs only (NewRequest
        carries them only then)."""
        if seq_id in self._seqs:
            raise ValueError(f"seq_id={seq_id} is already in the sampler; remove it before adding it again")
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else sequence_seed(self.seed, seq_id)
            generator = torch.Generator().manual_seed(seed & _MASK64)
        penalties = SeqPenalties(params, prompt_token_ids) if params.adjusts_logits else None
        self._seqs[seq_id] = _SeqState(params, generator, penalties, tuple(prompt_token_ids))

    def add_requests(self, new_requests: Iterable[NewRequest]) -> None:
        for request in new_requests:
            self.add(request.seq_id, request.params, request.prompt_token_ids)

    def prompt_logprobs_of(self, seq_id: int) -> tuple[int, tuple[int, ...]] | None:
        """(top-N, the prompt) of a sequence that asked for its prompt's logprobs; else None."""
        st = self._seqs.get(seq_id)
        if st is None or st.params.prompt_logprobs is None:
            return None
        return st.params.prompt_logprobs, st.prompt

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
        u = torch.tensor(_uniforms(states), dtype=torch.float64, device=logits.device)   # [B]
        penalties = [st.penalties for st in states]
        token_ids = draw_rows(adjusted_logits(logits, penalties), [st.params for st in states], u)
        logprobs = _logprobs(logits, token_ids, states)                        # from the raw logits
        ids = token_ids.tolist()
        record_tokens(penalties, ids)
        return [SampledToken(s, t, *lp) for s, t, lp in zip(seq_ids, ids, logprobs)]

    def step_columns(self, seq_ids: list[int], vocab_size: int) -> dict[str, torch.Tensor]:
        """The inputs of sampling inside a recorded step (`draw_in_step`), one row per sequence, on the
        CPU: mode, parameters, and each non-greedy sequence's uniform for this step, drawn now from its
        generator (the one the host path would draw after the step: the same tokens). A row with
        penalties goes to the step as greedy: the host redraws it (`finish_in_step`), so the step need
        not run its path. Every row greedy without penalties: no columns (the argmax variant reads none)."""
        states = [self._state(s) for s in seq_ids]
        if all(st.generator is None and st.penalties is None for st in states):
            return {}
        modes = [GREEDY if st.penalties else _mode(st.params) for st in states]
        return {"sample_mode": torch.tensor(modes, dtype=torch.int64),
                **RowParams.of([st.params for st in states], vocab_size).columns(),
                "uniform": torch.tensor(_uniforms(states), dtype=torch.float64)}

    def finish_in_step(self, picked: torch.Tensor, logits: torch.Tensor, seq_ids: list[int],
                       columns: dict[str, torch.Tensor]) -> list[SampledToken]:
        """Tokens from a step that sampled: picked = [2, >= n] (ids, fits) on the device, read with ONE
        copy to the host; a row that did not fit its candidates (then with a full sort) or that asks for
        penalties redraws here, with the step's uniform, and rows that asked for logprobs get them from
        the step's logits (all only where asked)."""
        n = len(seq_ids)
        ids, fits = picked[:, :n].tolist()
        self.in_step_finishes += 1
        states = [self._state(s) for s in seq_ids]
        redo = [i for i in range(n) if not fits[i] or states[i].penalties]
        if redo:
            rows = torch.tensor(redo, device=logits.device)
            penalties = [states[i].penalties for i in redo]
            u = columns["uniform"][redo].to(logits.device)      # the step's: the host path's uniforms
            again = draw_rows(adjusted_logits(logits[rows].float(), penalties), [states[i].params for i in redo], u)
            for i, t in zip(redo, again.tolist()):
                ids[i] = t
        logprobs = [(None, None)] * n
        if any(st.params.logprobs is not None for st in states):
            logprobs = _logprobs(logits[:n].float(), torch.tensor(ids, device=logits.device), states)
        record_tokens([st.penalties for st in states], ids)
        return [SampledToken(s, t, *lp) for s, t, lp in zip(seq_ids, ids, logprobs)]

    def _state(self, seq_id: int) -> _SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"seq_id={seq_id} has no sampling state: add() it (from its NewRequest) before "
                           f"sampling it") from None


GREEDY, PLAIN, FILTERED = 0, 1, 2   # a row's sampling path (the `sample_mode` step input)


def _mode(params) -> int:
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
        paths[_mode(p)].append(i)
    token_ids = torch.empty(len(params), dtype=torch.long, device=logits.device)
    if paths[GREEDY]:
        token_ids[paths[GREEDY]] = _rows(logits, paths[GREEDY]).argmax(dim=-1)
    for rows, draw in ((paths[PLAIN], _draw_plain), (paths[FILTERED], _draw_filtered)):
        if rows:
            cols = RowParams.of([params[i] for i in rows], logits.shape[1], logits.device)
            token_ids[rows] = draw(_rows(logits, rows), cols, _rows(u, rows)[:, None])   # u: [n, 1]
    return token_ids


def _uniform(state: _SeqState) -> float:
    """The sequence's one uniform of this sampled step."""
    return torch.rand((), dtype=torch.float64, generator=state.generator).item()


def _uniforms(states: list[_SeqState]) -> list[float]:
    """Each sequence's uniform of this step; greedy sequences (no generator) hold a neutral 0.5."""
    return [0.5 if st.generator is None else _uniform(st) for st in states]


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
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
