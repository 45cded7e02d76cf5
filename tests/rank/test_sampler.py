import math

import pytest
import torch

from phaseflip.engine.sampling_params import SamplingParams
from phaseflip.rank.messages import NewRequest, SampledToken
from phaseflip.rank import draw as draw_module
from phaseflip.rank.sampler import Sampler, sequence_seed
from phaseflip.rank.step_sampling import sampling_variants, variant_for

# One sampled sequence per path the sampler has: plain (temperature/min-p) and sorted (top-k/top-p).
PATH_PARAMS = [
    SamplingParams(temperature=1.3, seed=123),
    SamplingParams(temperature=0.9, min_p=0.01, seed=123),
    SamplingParams(temperature=1.1, top_p=0.95, seed=123),
    SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.001, seed=123),
]


def make_sampler(params_list, seed=0, first_id=0):
    sampler = Sampler(seed=seed)
    for i, params in enumerate(params_list):
        sampler.add(first_id + i, params)
    return sampler


def tokens(results):
    return [r.token_id for r in results]


def test_greedy_is_argmax_for_float32_and_bf16():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    sampler = make_sampler([SamplingParams(temperature=0.0)] * 6)
    assert tokens(sampler.sample(logits, list(range(6)))) == logits.argmax(-1).tolist()
    bf16 = logits.bfloat16()
    assert tokens(sampler.sample(bf16, list(range(6)))) == bf16.float().argmax(-1).tolist()


def test_greedy_tie_goes_to_lowest_index():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0]])
    assert tokens(make_sampler([SamplingParams(temperature=0)]).sample(logits, [0])) == [1]


@pytest.mark.parametrize("params", [
    *[SamplingParams(top_k=1, temperature=t, seed=s) for t, s in [(0.3, 1), (1.0, 2), (7.0, 3)]],
    SamplingParams(top_p=1e-6, temperature=2.0, seed=4),
    SamplingParams(min_p=1.0, temperature=2.0, seed=5),
], ids=["top_k1_t0.3", "top_k1_t1", "top_k1_t7", "top_p_tiny", "min_p1"])
def test_filters_that_keep_one_token_equal_greedy(params):
    gen = torch.Generator().manual_seed(1)
    sampler = make_sampler([params] * 8)
    for _ in range(5):
        logits = torch.randn(8, 500, generator=gen) * 3
        assert tokens(sampler.sample(logits, list(range(8)))) == logits.argmax(-1).tolist()


def draw_many(params, logits_row, num_seqs=2000, num_steps=10):
    """Counts of tokens drawn by num_seqs unseeded sequences sampled num_steps times on one row."""
    sampler = make_sampler([params] * num_seqs)
    batch = logits_row.expand(num_seqs, -1)
    counts = torch.zeros(logits_row.numel())
    for _ in range(num_steps):
        counts += torch.bincount(torch.tensor(tokens(sampler.sample(batch, list(range(num_seqs))))),
                                 minlength=logits_row.numel())
    return counts


def chi_square(counts, probs):
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, f"drew tokens of zero probability: {counts[~keep]}"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()), int(keep.sum()) - 1


LOGITS8 = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


@pytest.mark.parametrize("params, expected_probs", [
    (SamplingParams(temperature=0.7), (LOGITS8 / 0.7).softmax(-1)),
    (SamplingParams(temperature=1.5), (LOGITS8 / 1.5).softmax(-1)),
    (SamplingParams(temperature=1.0, top_k=5), torch.cat([LOGITS8[:5].softmax(-1), torch.zeros(3)])),
], ids=["t0.7", "t1.5", "top_k5"])
def test_temperature_sampling_matches_softmax(params, expected_probs):
    counts = draw_many(params, LOGITS8)
    stat, dof = chi_square(counts, expected_probs)
    assert stat < 3 * dof + 20, f"chi-square {stat:.1f} with {dof} dof: counts {counts.tolist()}"


PROBS4 = torch.tensor([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize("params, kept", [
    (SamplingParams(top_p=0.79), [0, 1]),
    (SamplingParams(top_p=0.81), [0, 1, 2]),
    (SamplingParams(top_p=0.4), [0]),
    (SamplingParams(min_p=0.5), [0, 1]),
    (SamplingParams(min_p=0.2), [0, 1, 2]),
    (SamplingParams(top_k=3), [0, 1, 2]),
    (SamplingParams(top_k=3, top_p=0.83), [0, 1]),
    (SamplingParams(top_k=3, min_p=0.5), [0, 1]),
    (SamplingParams(top_p=0.95, min_p=0.4), [0, 1]),  # top-p on the top-3 renormalised: 0.526, 0.316, 0.158
    (SamplingParams(top_k=0), [0, 1, 2, 3]),
    (SamplingParams(top_k=100), [0, 1, 2, 3]),
])
def test_filters_keep_exactly_the_expected_tokens_in_proportion(params, kept):
    counts = draw_many(params, PROBS4.log(), num_seqs=1000, num_steps=4)
    assert sorted(counts.nonzero().flatten().tolist()) == kept
    expected = torch.zeros(4)
    expected[kept] = PROBS4[kept] / PROBS4[kept].sum()
    stat, dof = chi_square(counts, expected)
    assert stat < 3 * dof + 20


# Batches of seq ids per step for the batch-independence test: seq 0 alone, first, last, in the middle.
ORDERS = [[0], [3, 0, 1], [5, 4, 3, 2, 1, 0], [0, 2], [1, 5, 0, 4], [2, 0, 3, 1, 4, 5]]


@pytest.fixture(params=[None, 16], ids=["candidates_default", "candidates_16"])
def num_candidates(request, monkeypatch):
    """Run a test with the default candidate count and with one small enough to force full-sort fallbacks."""
    if request.param is not None:
        monkeypatch.setattr(draw_module, "NUM_CANDIDATES", request.param)
    return draw_module.NUM_CANDIDATES


def test_seeded_sequence_is_independent_of_its_batch(num_candidates):
    vocab, steps = 1000, len(ORDERS)
    gen = torch.Generator().manual_seed(7)
    rows = [torch.randn(vocab, generator=gen) for _ in range(steps)]
    others = [SamplingParams(temperature=0), SamplingParams(top_p=0.5), SamplingParams(temperature=2.0),
              SamplingParams(top_k=3, seed=9), SamplingParams(min_p=0.1)]
    for params in PATH_PARAMS:
        alone = make_sampler([params])
        reference = [alone.sample(rows[t][None], [0])[0].token_id for t in range(steps)]
        assert len(set(reference)) > 1, "the rows should not make every step pick the same token"
        mixed = make_sampler([params] + others, seed=99)    # other engine seed: a seeded seq ignores it
        got = []
        for t, order in enumerate(ORDERS):
            batch = torch.randn(len(order), vocab, generator=gen)
            batch[order.index(0)] = rows[t]
            got.append(mixed.sample(batch, order)[order.index(0)].token_id)
        assert got == reference, f"{params}: {got} != {reference}"


FILTERED_PARAMS = [SamplingParams(top_k=k, top_p=p, min_p=m, temperature=t, seed=i)
                   for i, (k, p, m, t) in enumerate([(1, 1.0, 0.0, 1.0), (2, 1.0, 0.0, 1.0), (7, 1.0, 0.0, 2.0),
                                                     (0, 0.5, 0.0, 1.0), (0, 0.99, 0.0, 3.0), (20, 0.8, 0.0, 1.0),
                                                     (40, 1.0, 0.0, 1.0), (0, 0.9, 0.05, 1.0), (0, 0.3, 0.0, 0.2)])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_candidates_and_full_sort_give_the_same_tokens(monkeypatch, dtype):
    """Small candidate sets (ties cut at the boundary, nuclei larger than the set) must match a full sort."""
    gen = torch.Generator().manual_seed(21)
    batches = [(torch.randn(len(FILTERED_PARAMS), 64, generator=gen) * s).round().to(dtype) for s in (0.5, 2, 6)]
    ids = list(range(len(FILTERED_PARAMS)))

    def run(num_candidates):
        monkeypatch.setattr(draw_module, "NUM_CANDIDATES", num_candidates)
        sampler = make_sampler(FILTERED_PARAMS)
        return [tokens(sampler.sample(b, ids)) for b in batches for _ in range(4)]

    assert run(4) == run(8) == run(64)


def test_top_k_ties_go_to_the_lower_token_id(num_candidates):
    logits = torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0] + [-5.0] * 40)
    counts = draw_many(SamplingParams(top_k=2, temperature=5.0), logits, num_seqs=400, num_steps=2)
    assert counts.nonzero().flatten().tolist() == [1, 2]


def test_flat_nucleus_larger_than_the_candidates(monkeypatch):
    monkeypatch.setattr(draw_module, "NUM_CANDIDATES", 8)
    logits = torch.zeros(100)
    logits[:50] = 1.0                      # 50 equal tokens hold 73% of the mass
    counts = draw_many(SamplingParams(top_p=0.7), logits, num_seqs=1000, num_steps=5)
    expected = torch.zeros(100)
    expected[:48] = 1 / 48                 # 48 * 0.0146 = 0.70: the smallest prefix reaching top_p
    stat, dof = chi_square(counts, expected)
    assert stat < 3 * dof + 20, counts[:50].tolist()


def test_rows_whose_kept_set_fits_do_not_fall_back():
    logits = torch.randn(5, 5000, generator=torch.Generator().manual_seed(4)) * 4
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=50), SamplingParams(top_k=50, top_p=0.5),
              SamplingParams(top_p=0.8, min_p=0.1), SamplingParams(top_k=9000, top_p=0.9)]
    u = torch.full((5, 1), 0.5, dtype=torch.float64)
    _, fits = draw_module._draw_from_top(logits, draw_module.RowParams.of(params, 5000), u, 256)
    assert fits.tolist() == [True] * 5
    cols = draw_module.RowParams.of([SamplingParams(top_k=300)], 5000)
    _, fits = draw_module._draw_from_top(logits[:1], cols, u[:1], 256)
    assert fits.tolist() == [False]


def test_inverse_cdf_never_lands_on_a_zero_weight():
    cdf = torch.tensor([[0.25, 0.5, 0.5, 0.5]], dtype=torch.float64)     # the last two tokens were dropped
    for u in (0.0, 0.49, 0.5, 0.999999, 1.0):
        (pos,) = draw_module._search(cdf, torch.tensor([[u]], dtype=torch.float64)).flatten().tolist()
        assert pos == (0 if u < 0.5 else 1), u


def test_same_seed_in_two_sequences_gives_the_same_tokens():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(3)).expand(2, -1)
    sampler = make_sampler([SamplingParams(seed=5), SamplingParams(seed=5)])
    for _ in range(5):
        a, b = tokens(sampler.sample(logits, [0, 1]))
        assert a == b


def test_different_seeds_give_different_tokens():
    logits = torch.zeros(2, 1000)
    sampler = make_sampler([SamplingParams(seed=1), SamplingParams(seed=2)])
    steps = [tokens(sampler.sample(logits, [0, 1])) for _ in range(5)]
    assert [s[0] for s in steps] != [s[1] for s in steps]


def run_unseeded(engine_seed, seq_ids, steps=5):
    sampler = Sampler(seed=engine_seed)
    sampler.add_requests(NewRequest(s, SamplingParams(temperature=1.0), num_prompt_tokens=3) for s in seq_ids)
    logits = torch.zeros(len(seq_ids), 1000)
    return [tokens(sampler.sample(logits, seq_ids)) for _ in range(steps)]


def test_unseeded_sequences_are_reproducible_with_the_same_engine_seed():
    assert run_unseeded(0, [0, 1, 2]) == run_unseeded(0, [0, 1, 2])
    assert run_unseeded(0, [0, 1, 2]) != run_unseeded(1, [0, 1, 2])
    per_seq = list(zip(*run_unseeded(0, [0, 1, 2])))
    assert per_seq[0] != per_seq[1] != per_seq[2], "sequences of one engine must not share a stream"


def test_sequence_seed_is_a_stable_value():
    assert sequence_seed(0, 0) == sequence_seed(0, 0) != sequence_seed(0, 1) != sequence_seed(1, 0)
    assert 0 <= sequence_seed(-5, 2**70) < 2**64


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, logprobs=5),
                                    SamplingParams(temperature=0.5, top_k=20, logprobs=5, seed=1),
                                    SamplingParams(temperature=3.0, logprobs=3, seed=2)])
def test_logprobs_come_from_raw_logits(params):
    logits = torch.randn(2, 400, generator=torch.Generator().manual_seed(11)) * 2
    raw = logits.log_softmax(-1)
    sampler = make_sampler([params, SamplingParams(seed=3)])
    for _ in range(10):
        with_lp, without = sampler.sample(logits, [0, 1])
        assert without.logprob is None and without.top_logprobs is None
        assert with_lp.logprob == pytest.approx(raw[0, with_lp.token_id].item(), abs=1e-6)
        top = with_lp.top_logprobs
        n = params.logprobs
        assert len(top) == (n if with_lp.token_id in raw[0].topk(n).indices.tolist() else n + 1)
        first_n = list(top.items())[:n]
        assert [t for t, _ in first_n] == raw[0].topk(n).indices.tolist()
        assert [v for _, v in first_n] == pytest.approx(raw[0].topk(n).values.tolist(), abs=1e-6)
        assert top[with_lp.token_id] == pytest.approx(with_lp.logprob)


def test_logprobs_zero_returns_only_the_sampled_token():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(2))
    (result,) = make_sampler([SamplingParams(logprobs=0, seed=1)]).sample(logits, [0])
    assert list(result.top_logprobs) == [result.token_id]
    assert result.logprob == pytest.approx(logits.log_softmax(-1)[0, result.token_id].item(), abs=1e-6)


def test_empty_batch():
    sampler = make_sampler([SamplingParams()])
    assert sampler.sample(torch.empty(0, 10), []) == []


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, logprobs=2), SamplingParams(logprobs=2),
                                    SamplingParams(top_p=0.5, top_k=3, min_p=0.5, logprobs=1)])
def test_vocab_of_one(params):
    (result,) = make_sampler([params]).sample(torch.tensor([[4.0]]), [0])
    assert result == SampledToken(0, 0, 0.0, {0: 0.0})


def test_logits_are_not_modified():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(5))
    before = logits.clone()
    make_sampler(PATH_PARAMS).sample(logits, [0, 1, 2, 3])
    assert torch.equal(logits, before)


def test_lifecycle_errors():
    sampler = make_sampler([SamplingParams()])
    with pytest.raises(ValueError, match="seq_id=0 is already in the sampler"):
        sampler.add(0, SamplingParams())
    with pytest.raises(KeyError, match="seq_id=7 has no sampling state"):
        sampler.sample(torch.zeros(1, 10), [7])
    with pytest.raises(ValueError, match=r"logits of shape \(2, 10\) do not match 1 seq_ids"):
        sampler.sample(torch.zeros(2, 10), [0])
    sampler.remove(0)
    sampler.remove(12345)   # unknown ids are ignored
    assert 0 not in sampler and len(sampler) == 0
    with pytest.raises(KeyError, match="seq_id=0"):
        sampler.sample(torch.zeros(1, 10), [0])


def test_results_are_python_numbers():
    (r,) = make_sampler([SamplingParams(logprobs=1, seed=0)]).sample(torch.randn(1, 20), [0])
    assert type(r.token_id) is int and type(r.logprob) is float
    assert all(type(k) is int and type(v) is float and math.isfinite(v) for k, v in r.top_logprobs.items())


IN_STEP_PARAMS = [
    SamplingParams(temperature=0.0), *PATH_PARAMS,
    SamplingParams(top_k=500, seed=9),                         # more than the candidates: a full-sort redraw
    SamplingParams(temperature=0.7, top_p=0.99, seed=4, logprobs=3),
    SamplingParams(temperature=0.0, logprobs=2), SamplingParams(min_p=0.2, seed=1),
]


PLAIN_ONLY = [p for p in IN_STEP_PARAMS if p.greedy or not (p.top_k_enabled or p.top_p < 1)]
FILTERED_ONLY = [p for p in IN_STEP_PARAMS if p.greedy or p.top_k_enabled or p.top_p < 1]


@pytest.mark.parametrize("params,variant", [(IN_STEP_PARAMS, "sampled"), (PLAIN_ONLY, "plain"),
                                            (FILTERED_ONLY, "filtered")])
def test_sampling_inside_the_step_gives_the_host_samplers_tokens(monkeypatch, params, variant):
    """What a recorded decode step runs (each path on every row, each row keeping its own; uniforms drawn
    before the step) and the host's finish give Sampler.sample's tokens and logprobs, step after step
    from the same seeds, and so do padded rows behind them."""
    monkeypatch.setattr(draw_module, "NUM_CANDIDATES", 64)   # candidate draws and full-sort redraws both
    ids = list(range(len(params)))
    host, in_step = make_sampler(params), make_sampler(params)
    gen, redraws = torch.Generator().manual_seed(11), 0
    for _ in range(6):
        logits = torch.randn(len(ids), 1000, generator=gen) * 3
        want = host.sample(logits, ids)
        cols = in_step.step_columns(ids, 1000)
        assert variant_for(cols) == variant
        padded = {k: torch.cat([v, v[:1] * 0 + (0.5 if k == "uniform" else 1 if k != "min_p" else 0)])
                  for k, v in cols.items()}      # one padding row, as a bucket's buffers hold it
        padded["sample_mode"][-1] = 0
        logits_padded = torch.cat([logits, logits[:1]])
        picked, out_logits = sampling_variants(lambda m: logits_padded, lambda h: h)[variant](padded)
        redraws += picked[1, :len(ids)].tolist().count(0)
        assert in_step.finish_in_step(picked, out_logits, ids, cols) == want
    assert redraws > 0 or variant == "plain"


def test_an_all_greedy_decode_replays_the_argmax_variant():
    sampler = make_sampler([SamplingParams(temperature=0.0)] * 3)
    cols = sampler.step_columns([0, 1, 2], 300)
    assert cols == {} and variant_for(cols) == "greedy"   # nothing built: the argmax variant reads no column
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(2))
    picked, _ = sampling_variants(lambda m: logits, lambda h: h)["greedy"](cols)
    assert tokens(sampler.finish_in_step(picked, logits, [0, 1, 2], cols)) == logits.argmax(-1).tolist()
