"""Penalties and logit bias: the adjusted logits against a plain reference, what they change in a draw,
the host path and the in-step path giving the same tokens, and end to end through LLM (1 rank, and 2
ranks flipping between PP and TP every step)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from phaseflip import LLM, SamplingParams
from phaseflip.rank import draw as draw_module
from phaseflip.rank.penalties import SeqPenalties, adjusted_logits
from phaseflip.rank.messages import NewRequest
from phaseflip.rank.sampler import Sampler
from phaseflip.rank.step_sampling import sampling_variants, variant_for
from tests.engine.test_llm import model_dir, one_thread  # noqa: F401  (fixtures: the tiny llama, one thread)

VOCAB = 50


def reference(row: torch.Tensor, params: SamplingParams, prompt, output) -> torch.Tensor:
    """vLLM V1's order, token by token: bias, repetition (prompt or output), frequency, presence."""
    x, counts = row.tolist(), Counter(output)
    for t, b in params.logit_bias:
        x[t] += b
    for t in range(len(x)):
        if params.repetition_penalty != 1 and (t in prompt or counts[t]):
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
        x[t] -= params.frequency_penalty * counts[t] + params.presence_penalty * (counts[t] > 0)
    return torch.tensor(x)


ROWS = [  # (params, prompt, output so far)
    (SamplingParams(presence_penalty=1.5), (), (3, 3, 7)),
    (SamplingParams(frequency_penalty=0.7), (), (3, 3, 7, 3, 9)),
    (SamplingParams(frequency_penalty=-0.4, presence_penalty=-1.0), (1, 2), (4, 4)),
    (SamplingParams(repetition_penalty=1.8), (1, 2, 3, 30), (5, 6, 6)),
    (SamplingParams(repetition_penalty=0.5), (0, 10, 11), (12,)),
    (SamplingParams(logit_bias={4: -100, "8": 3.5, 49: 0.25}), (1,), (4, 4)),
    (SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2, logit_bias={3: -2.0}),
     (3, 20, 21), (3, 22, 22, 40)),
]


def state_after(params, prompt, output) -> SeqPenalties:
    state = SeqPenalties(params, prompt)
    for t in output:
        state.adjust(torch.zeros(VOCAB))   # what a sampled step does before it records the token
        state.record(t)
    return state


def test_adjusted_logits_equal_the_reference():
    logits = torch.randn(len(ROWS) + 1, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    states = [state_after(*row) for row in ROWS] + [None]    # the last row asks for nothing
    got = adjusted_logits(logits, states)
    for i, (params, prompt, output) in enumerate(ROWS):
        want = reference(logits[i], params, prompt, output)
        assert torch.allclose(got[i], want, atol=1e-5), f"row {i}: {params}"
        assert not torch.equal(got[i], logits[i]), f"row {i}: nothing was adjusted"
    assert torch.equal(got[-1], logits[-1])


def test_logits_without_adjustments_are_not_copied_and_the_raw_ones_are_not_modified():
    logits = torch.randn(2, VOCAB)
    assert adjusted_logits(logits, [None, None]) is logits
    before = logits.clone()
    adjusted_logits(logits, [state_after(*ROWS[0]), None])
    assert torch.equal(logits, before)


def make_sampler(params_list, prompts=None):
    sampler = Sampler(seed=0)
    for i, params in enumerate(params_list):
        sampler.add_requests([NewRequest(i, params, 3, tuple(prompts[i]) if prompts else ())])
    return sampler


def tokens(results):
    return [r.token_id for r in results]


def test_a_large_negative_bias_on_the_greedy_token_picks_another():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    top, second = logits[0].topk(2).indices.tolist()
    sampler = make_sampler([SamplingParams(temperature=0, logit_bias={top: -100})])
    for _ in range(3):
        assert tokens(sampler.sample(logits, [0])) == [second]


def test_a_frequency_penalty_after_repeated_tokens_changes_the_choice():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6] = 2.0, 1.0
    plain = make_sampler([SamplingParams(temperature=0)])
    penalized = make_sampler([SamplingParams(temperature=0, frequency_penalty=0.6)])
    assert [tokens(plain.sample(logits, [0]))[0] for _ in range(4)] == [5, 5, 5, 5]
    # 2 - 0.6 n against 1: token 5 until it was drawn twice, then 6 (1 - 0.6 = 0.4 after once), ...
    assert [tokens(penalized.sample(logits, [0]))[0] for _ in range(4)] == [5, 5, 6, 5]


def test_the_repetition_penalty_reads_the_prompt_from_the_new_request():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6] = 2.0, 1.5
    params = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert tokens(make_sampler([params], prompts=[(5,)]).sample(logits, [0])) == [6]   # 2 / 1.5 < 1.5
    assert tokens(make_sampler([params], prompts=[(7,)]).sample(logits, [0])) == [5]


def test_logprobs_stay_those_of_the_raw_logits():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2))
    top = logits[0].argmax().item()
    (r,) = make_sampler([SamplingParams(temperature=0, logit_bias={top: -100}, logprobs=2)]).sample(logits, [0])
    raw = logits[0].log_softmax(-1)
    assert r.token_id != top and r.logprob == pytest.approx(raw[r.token_id].item(), abs=1e-6)
    assert r.top_logprobs[top] == pytest.approx(raw[top].item(), abs=1e-6)


def test_remove_drops_the_counts():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 1.0
    params = SamplingParams(temperature=0, presence_penalty=2.0)
    sampler = make_sampler([params])
    assert tokens(sampler.sample(logits, [0])) + tokens(sampler.sample(logits, [0])) == [5, 0]
    sampler.remove(0)
    sampler.add(0, params)
    assert tokens(sampler.sample(logits, [0])) == [5]


# Penalized rows of every path, seeded, beside rows without penalties (some redrawn for the candidates).
MIXED = [
    SamplingParams(temperature=0.0, frequency_penalty=0.8, logit_bias={0: 5.0}),
    SamplingParams(temperature=1.2, presence_penalty=1.0, seed=3),
    SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.6, seed=4),
    SamplingParams(top_k=300, frequency_penalty=1.5, seed=5),                   # past the candidates
    SamplingParams(temperature=0.9, min_p=0.05, logit_bias={7: 8.0, 9: -100}, seed=6),
    SamplingParams(temperature=0.0), SamplingParams(temperature=1.1, seed=7),
    SamplingParams(top_k=500, seed=9), SamplingParams(top_p=0.95, seed=8, logprobs=2),
]
PROMPTS = [(1, 2, 3)] * len(MIXED)


def step_tokens(sampler, logits, ids):
    """A decode step that samples inside the recorded step, as runner.execute runs it."""
    cols = sampler.step_columns(ids, logits.shape[1])
    picked, out_logits = sampling_variants(lambda m: logits, lambda h: h)[variant_for(cols)](cols)
    return sampler.finish_in_step(picked, out_logits, ids, cols)


def test_host_and_in_step_paths_give_the_same_tokens(monkeypatch):
    monkeypatch.setattr(draw_module, "NUM_CANDIDATES", 64)
    ids = list(range(len(MIXED)))
    host, in_step = make_sampler(MIXED, PROMPTS), make_sampler(MIXED, PROMPTS)
    gen, history = torch.Generator().manual_seed(11), []
    for _ in range(8):
        logits = torch.randn(len(ids), 1000, generator=gen) * 2
        logits[:, :10] += 4.0      # a few likely tokens, so penalties meet repeats
        want = host.sample(logits, ids)
        assert step_tokens(in_step, logits, ids) == want
        history.append(tokens(want))
    per_seq = list(zip(*history))
    assert all(9 not in seq for seq in per_seq[4:5]), "a -100 bias must keep its token out"
    assert any(len(set(seq)) < len(seq) for seq in per_seq), "no sequence repeated a token: a weak test"


def test_a_penalized_seeded_sequence_ignores_its_batch_and_its_path():
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randn(200, generator=gen) for _ in range(6)]
    target = SamplingParams(temperature=1.0, top_p=0.9, frequency_penalty=1.0, repetition_penalty=1.2, seed=42)
    alone = make_sampler([target], [(1, 2)])
    want = [tokens(alone.sample(r[None], [0]))[0] for r in rows]
    mixed = make_sampler([target] + MIXED[:4], [(1, 2)] + PROMPTS[:4])
    got = []
    for t, r in enumerate(rows):
        batch = torch.randn(5, 200, generator=gen)
        batch[t % 5], order = r, [(i - t) % 5 for i in range(5)]   # seq 0 in row t % 5
        sample = mixed.sample if t % 2 else lambda lg, ids: step_tokens(mixed, lg, ids)
        got.append(sample(batch, order)[t % 5].token_id)
    assert got == want


def test_penalized_rows_go_to_the_step_as_greedy():
    sampler = make_sampler([SamplingParams(temperature=0.0), SamplingParams(presence_penalty=0.5, seed=1),
                            SamplingParams(top_k=5, logit_bias={1: 1.0}, seed=2)])
    cols = sampler.step_columns([0, 1, 2], VOCAB)
    assert variant_for(cols) == "greedy"
    assert cols["uniform"][1] != 0.5 and cols["uniform"][2] != 0.5   # their generators still drew


# -- end to end ---------------------------------------------------------------------------------------

NEW = 24
ENGINE = dict(dtype="float32", max_num_seqs=4, max_model_len=96)


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model=str(model_dir), **ENGINE) as engine:
        yield engine


def run(llm, prompts, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def num_repeats(ids) -> int:
    return len(ids) - len(set(ids))


def repeating_prompts(llm) -> list[list[int]]:
    """Prompts whose greedy continuation repeats tokens a lot on the tiny model (first few that do)."""
    candidates = [[t, t + 1, t + 2] for t in range(10, 300, 23)]
    outs = run(llm, candidates)
    found = [p for p, o in zip(candidates, outs) if num_repeats(o) >= NEW // 3][:3]
    assert found, "no prompt makes the tiny model repeat itself: pick other candidates"
    return found


def test_the_repetition_penalty_reaches_the_prompt_through_the_engine(llm):
    """A prompt ending where greedy repeats its last token: only the prompt can penalize the first one."""
    prompt = repeating_prompts(llm)[0]
    plain = run(llm, [prompt])[0]
    k = next(k for k in range(NEW - 1) if plain[k] == plain[k + 1])
    longer = prompt + plain[:k + 1]
    assert run(llm, [longer])[0][0] == plain[k]
    assert run(llm, [longer], repetition_penalty=2.0)[0][0] != plain[k]


def test_prompt_tokens_go_to_the_ranks_only_for_a_repetition_penalty():
    from phaseflip.engine.rank_notices import RankNotices
    from phaseflip.engine.requests import Sequence
    params = [SamplingParams(repetition_penalty=1.1), SamplingParams(frequency_penalty=1.0), SamplingParams()]
    seqs = [Sequence(seq_id=i, request_id=str(i), prompt_token_ids=[4, 5, 6], params=p) for i, p in enumerate(params)]
    assert [r.prompt_token_ids for r in RankNotices().announce(seqs)] == [(4, 5, 6), (), ()]


def test_a_minus_100_bias_keeps_the_first_greedy_token_out(llm):
    prompts = [[40, 41, 42], [100, 7, 300]]
    for prompt, plain in zip(prompts, run(llm, prompts)):
        first = plain[0]
        (biased,) = run(llm, [prompt], logit_bias={first: -100})
        assert first not in biased and biased != plain


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.5), dict(frequency_penalty=1.0),
                                dict(presence_penalty=1.5)])
def test_penalties_cut_the_repeats_of_a_greedy_output(llm, kw):
    prompts = repeating_prompts(llm)
    for plain, penalized in zip(run(llm, prompts), run(llm, prompts, **kw)):
        assert penalized != plain
        assert num_repeats(penalized) < num_repeats(plain), (plain, penalized)


MIXED_E2E = [SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, repetition_penalty=1.4),
             SamplingParams(temperature=0.8, max_tokens=NEW, ignore_eos=True, frequency_penalty=0.9,
                            logit_bias={5: 4.0}, seed=7),
             SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, presence_penalty=1.0,
                            logit_bias={60: -100})]


def test_decodes_sampled_in_the_step_and_on_the_host_give_the_same_tokens(llm):
    prompts = repeating_prompts(llm)[:2] + [[40, 41, 42]]
    runtime = llm.ranks.runtime
    finishes = runtime.sampler.in_step_finishes
    in_step = [o.outputs[0].token_ids for o in llm.generate(prompts, MIXED_E2E, use_tqdm=False)]
    assert runtime.sampler.in_step_finishes > finishes, "no decode step sampled inside the step"
    runners = list(runtime.runners.values())
    try:
        for runner in runners:
            runner.samples_in_step = False
        on_host = [o.outputs[0].token_ids for o in llm.generate(prompts, MIXED_E2E, use_tqdm=False)]
    finally:
        for runner in runners:
            runner.samples_in_step = True
    assert in_step == on_host


def test_two_ranks_flipping_every_step_give_the_one_rank_tokens(llm, model_dir):
    prompts, params = repeating_prompts(llm)[:2] + [[40, 41, 42]], MIXED_E2E
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(model=str(model_dir), **ENGINE, world_size=2, flip_every_steps=1) as two:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
        assert two.stats()["flips"] >= 4
    assert got == want


def test_min_tokens_holds_off_the_stop_tokens_on_one_rank_and_two_flipping(llm, model_dir):
    """The stop token greedy gives second: without min_tokens it ends the output there; with min_tokens=6
    it is not drawn before 6 tokens (nor ends them), and two ranks flipping every step agree."""
    prompt = [40, 41, 42]
    plain = run(llm, [prompt])[0]
    stop = next(t for t in plain[1:] if t != plain[0])
    params = SamplingParams(temperature=0.0, max_tokens=NEW, stop_token_ids=[stop])
    early = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert early[-1] == stop and len(early) < 6
    held = SamplingParams(temperature=0.0, max_tokens=NEW, stop_token_ids=[stop], min_tokens=6)
    (out,) = llm.generate([prompt], held, use_tqdm=False)
    got = out.outputs[0].token_ids
    assert len(got) >= 6 and stop not in got[:6], got
    with LLM(model=str(model_dir), **ENGINE, world_size=2, flip_every_steps=1) as two:
        assert two.generate([prompt], held, use_tqdm=False)[0].outputs[0].token_ids == got
    with pytest.raises(ValueError, match=r"min_tokens=30 is invalid: must be an int >= 0 and <= max_tokens \(24\)"):
        SamplingParams(max_tokens=NEW, min_tokens=30)


def test_a_bias_beyond_the_vocabulary_is_refused_naming_the_request(llm):
    params = [SamplingParams(), SamplingParams(logit_bias={3: 1.0, 384: -5.0})]
    with pytest.raises(ValueError, match=r"request 1: logit_bias token id 384 is outside the vocabulary \[0, 384\)"):
        llm.generate([[5, 6], [7, 8]], params, use_tqdm=False)
