"""The sampler of the output rank: logits of the sampled positions in, one token per sequence out.

Owns: the per-sequence sampling state kept on the output rank between steps (a sequence's
SamplingParams, its own torch.Generator and, where its params ask for penalties or a logit bias, its
penalties.SeqPenalties), each step's uniforms, and the logprobs; the draw of a token from a row of
logits is draw.py's. It never schedules, never decides when a sequence stops (the controller
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

The draw itself (the paths, their filters and ties) is draw.py's.

Logprobs are computed from the RAW logits (log_softmax before temperature and the filters), as vLLM V1
does by default: the sampled token's logprob and the top-N as {token_id: logprob}, highest first, plus
the sampled token when it is not among them.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from phaseflip.rank.draw import GREEDY, RowParams, draw_rows, mode_of, take_rows
from phaseflip.rank.penalties import SeqPenalties, adjusted_logits, record_tokens
from phaseflip.rank.messages import NewRequest, SampledToken

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
        modes = [GREEDY if st.penalties else mode_of(st.params) for st in states]
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


def _uniform(state: _SeqState) -> float:
    """The sequence's one uniform of this sampled step."""
    return torch.rand((), dtype=torch.float64, generator=state.generator).item()


def _uniforms(states: list[_SeqState]) -> list[float]:
    """Each sequence's uniform of this step; greedy sequences (no generator) hold a neutral 0.5."""
    return [0.5 if st.generator is None else _uniform(st) for st in states]


def _logprobs(logits: torch.Tensor, token_ids: torch.Tensor, states: list[_SeqState]) -> list[tuple]:
    """(logprob, top_logprobs) per row; (None, None) for rows that did not ask."""
    out: list[tuple] = [(None, None)] * len(states)
    rows = [i for i, st in enumerate(states) if st.params.logprobs is not None]
    if not rows:
        return out
    logp = take_rows(logits, rows).log_softmax(dim=-1)                                        # [n, V]
    row_tokens = take_rows(token_ids, rows)
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
