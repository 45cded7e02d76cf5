"""Fuzzing the API: random prompts (token ids valid and invalid, unicode and empty
strings, dicts, numpy ints), stop strings that span tokens, huge max_tokens, 0 to 500 prompts and mixed
SamplingParams (valid and invalid). Every call returns the right shape or raises a validation error
naming the bad value, and each is bounded in time. Seeded: a failure reproduces."""
from __future__ import annotations

import random

import numpy as np
import pytest

from phaseflip import LLM, SamplingParams
from tests.reliability.fuzz_cases import VOCAB, random_params, random_prompt
from tests.reliability.support import ENGINE, MAX_MODEL_LEN, assert_settled, deadline

CALL_S = 60  # no call may take longer


@pytest.fixture(scope="module")
def llm(model):
    with LLM(model=model, **{**ENGINE, "max_num_seqs": 32}) as engine:
        yield engine


def check_outputs(llm, prompts, token_ids, params, outs) -> None:
    """The shape and the invariants of a successful call."""
    assert len(outs) == len(prompts)
    assert len({o.request_id for o in outs}) == len(outs)
    for o, ids, sp in zip(outs, token_ids, params):
        c = o.outputs[0]
        assert o.finished and len(o.outputs) == 1 and o.prompt_token_ids == ids
        assert c.finish_reason in ("stop", "length") and 1 <= len(c.token_ids)
        assert all(0 <= t < VOCAB for t in c.token_ids) and isinstance(c.text, str)
        assert len(ids) + len(c.token_ids) <= MAX_MODEL_LEN
        if sp.max_tokens is not None:
            assert len(c.token_ids) <= sp.max_tokens
        if c.finish_reason == "length":
            assert len(c.token_ids) == sp.max_tokens or len(ids) + len(c.token_ids) == MAX_MODEL_LEN
        if sp.logprobs is not None:
            assert len(c.logprobs) == len(c.token_ids)
        if isinstance(c.stop_reason, str):
            assert c.stop_reason in sp.stop and (sp.include_stop_str_in_output or c.stop_reason not in c.text)


def expected_error(llm, prompts):
    """(type, substring) of the validation error the batch must raise, or None: the first bad prompt."""
    tok = llm.get_tokenizer()
    for i, (p, bad) in enumerate(prompts):
        if bad is not None:
            return bad[0], f"prompt {i}", bad[1]
        text = p.get("prompt", p) if isinstance(p, dict) else p
        if isinstance(text, str) and len(tok.encode(text)) >= MAX_MODEL_LEN:
            return ValueError, f"prompt {i} has", f"max_model_len={MAX_MODEL_LEN}"
    return None


def token_ids_of(llm, p) -> list[int]:
    text = p.get("prompt", p.get("prompt_token_ids")) if isinstance(p, dict) else p
    return llm.get_tokenizer().encode(text) if isinstance(text, str) else [int(t) for t in text]


@pytest.mark.parametrize("seed", range(40))
def test_random_batches_return_the_right_shape_or_name_the_bad_value(llm, seed):
    rng = random.Random(seed)
    n = rng.choice([0, 1, 2, 5, 17, 40, 100, 250])
    cases = [random_prompt(rng, bad_rate=0.0) for _ in range(n)]
    if n and seed % 2:  # odd seeds: one bad prompt at a random place
        cases[rng.randrange(n)] = random_prompt(rng, bad_rate=1.0)
    params = [random_params(rng, bad_rate=0.0) for _ in range(n)]
    prompts = [p for p, _ in cases]
    error = expected_error(llm, cases)
    with deadline(CALL_S, f"fuzz batch {seed} ({n} prompts)"):
        if error is None:
            outs = llm.generate(prompts, params, use_tqdm=False)
            check_outputs(llm, prompts, [token_ids_of(llm, p) for p in prompts], params, outs)
        else:
            with pytest.raises(error[0]) as info:
                llm.generate(prompts, params, use_tqdm=False)
            assert error[1] in str(info.value) and error[2] in str(info.value), (error, str(info.value))
    assert_settled(llm)


def test_random_sampling_params_are_accepted_or_name_the_bad_value():
    rng = random.Random(0)
    num_bad = 0
    for _ in range(400):
        kwargs, bad = random_params(rng, bad_rate=0.3, as_kwargs=True)
        if bad is None:
            SamplingParams(**kwargs)
            continue
        num_bad += 1
        with pytest.raises(ValueError) as info:
            SamplingParams(**kwargs)
        assert bad in str(info.value), (kwargs, str(info.value))
    assert num_bad > 100


def test_zero_to_five_hundred_prompts(llm):
    rng = random.Random(5)
    for n in (0, 1, 500):
        prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 9))] for _ in range(n)]
        params = [random_params(rng, bad_rate=0.0, max_tokens=rng.randrange(1, 4)) for _ in range(n)]
        with deadline(CALL_S, f"a batch of {n} prompts"):
            outs = llm.generate(prompts, params, use_tqdm=False)
        check_outputs(llm, prompts, prompts, params, outs)
        assert_settled(llm)


@pytest.mark.parametrize("max_tokens", [10**9, None])
def test_huge_max_tokens_ends_at_max_model_len(llm, max_tokens):
    prompts = [[5, 6, 7], [9] * 100, np.array([11, 12], dtype=np.int64).tolist()]
    params = SamplingParams(temperature=0.7, seed=1, max_tokens=max_tokens, ignore_eos=True)
    with deadline(CALL_S, f"max_tokens={max_tokens}"):
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(p) + len(o.outputs[0].token_ids) for p, o in zip(prompts, outs)] == [MAX_MODEL_LEN] * 3
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def consistent_prefixes(tok, token_ids) -> bool:
    """Every prefix of the tokens decodes to a prefix of the whole text (no split characters)."""
    full = tok.decode(token_ids)
    return all(full.startswith(tok.decode(token_ids[:k])) for k in range(1, len(token_ids)))


def spanning_stops(tok, token_ids, rng, count: int):
    """(stop string, include) pairs whose first occurrence spans a token boundary."""
    full = tok.decode(token_ids)
    ends = [len(tok.decode(token_ids[:k])) for k in range(1, len(token_ids) + 1)]
    found = []
    for _ in range(200):
        start, size = rng.randrange(0, len(full) - 1), rng.randrange(2, 5)
        s = full[start:start + size]
        first = full.find(s)
        crosses = any(first < e < first + len(s) for e in ends)
        if len(s) >= 2 and s.isascii() and s.isprintable() and crosses and (s, True) not in found:
            found.append((s, rng.random() < 0.5))
        if len(found) == count:
            break
    return found


def test_stop_strings_that_span_tokens_cut_the_text_at_their_first_occurrence(llm):
    tok, rng, tested = llm.get_tokenizer(), random.Random(3), 0
    base = dict(temperature=0.0, max_tokens=40, ignore_eos=True)
    for prompt in ("The quick brown fox", "What is 2 + 2?", "Hello, world!", "Pack my box"):
        full_ids = llm.generate([prompt], SamplingParams(**base), use_tqdm=False)[0].outputs[0].token_ids
        if not consistent_prefixes(tok, full_ids):
            continue
        full = tok.decode(full_ids)
        for stop, include in spanning_stops(tok, full_ids, rng, 4):
            with deadline(CALL_S, f"stop={stop!r}"):
                c = llm.generate([prompt], SamplingParams(**base, stop=[stop], include_stop_str_in_output=include),
                                 use_tqdm=False)[0].outputs[0]
            at = full.find(stop)
            assert (c.finish_reason, c.stop_reason) == ("stop", stop)
            assert c.text == full[:at + len(stop)] if include else c.text == full[:at]
            k = next(k for k in range(1, len(full_ids) + 1) if stop in tok.decode(full_ids[:k]))
            assert c.token_ids == full_ids[:k], "the tokens that made the stop string are kept, no more"
            tested += 1
    assert tested >= 8, f"only {tested} spanning stop strings were tried"
