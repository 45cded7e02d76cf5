import pickle
import re

import pytest

from phaseflip.engine.sampling_params import MAX_LOGPROBS, SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, None, 16)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == ((), (), False, None)
    assert (p.include_stop_str_in_output, p.skip_special_tokens) == (False, True)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias) == (0.0, 0.0, 1.0, ())
    assert not p.greedy and not p.top_k_enabled and not p.adjusts_logits


@pytest.mark.parametrize("kwargs, message", [
    ({"n": 0}, "n=0 is invalid: must be an int >= 1"),
    ({"n": 1.0}, "n=1.0 is invalid: must be an int >= 1"),
    ({"n": True}, "n=True is invalid"),
    ({"presence_penalty": 3.0}, "presence_penalty=3.0 is invalid: must be in [-2, 2]"),
    ({"presence_penalty": float("nan")}, "presence_penalty=nan is invalid"),
    ({"frequency_penalty": -2.5}, "frequency_penalty=-2.5 is invalid: must be in [-2, 2]"),
    ({"repetition_penalty": -1.0}, "repetition_penalty=-1.0 is invalid: must be a finite number > 0"),
    ({"repetition_penalty": 0}, "repetition_penalty=0 is invalid: must be a finite number > 0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty=inf is invalid"),
    ({"logit_bias": {5: 200}}, "logit_bias[5]=200 is invalid: must be a number in [-100, 100]"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias[5]=nan is invalid"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias key 'abc' is invalid: must be a token id (an int >= 0, or a str "
                                   "of digits)"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias key -1 is invalid"),
    ({"logit_bias": {"-1": 1.0}}, "logit_bias key '-1' is invalid"),
    ({"logit_bias": {1.5: 1.0}}, "logit_bias key 1.5 is invalid"),
    ({"logit_bias": {5: 1.0, "5": 2.0}}, "logit_bias token id 5 is given twice"),
    ({"logit_bias": [5, 1.0]}, "logit_bias entry 5 is invalid: must be a (token_id, bias) pair"),
    ({"logit_bias": 5}, "logit_bias=5 is invalid: must be a dict {token_id: bias}, pairs, or None"),
    ({"temperature": -0.5}, "temperature=-0.5 is invalid: must be a finite number >= 0"),
    ({"temperature": float("nan")}, "temperature=nan is invalid"),
    ({"temperature": float("inf")}, "temperature=inf is invalid"),
    ({"temperature": "hot"}, "temperature='hot' is invalid"),
    ({"top_p": 0.0}, "top_p=0.0 is invalid: must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p=1.5 is invalid: must be in (0, 1]"),
    ({"top_p": -0.1}, "top_p=-0.1 is invalid"),
    ({"top_k": -2}, "top_k=-2 is invalid: must be an int >= 1, or 0 or -1 to disable"),
    ({"top_k": 2.5}, "top_k=2.5 is invalid"),
    ({"min_p": -0.1}, "min_p=-0.1 is invalid: must be in [0, 1]"),
    ({"min_p": 1.1}, "min_p=1.1 is invalid: must be in [0, 1]"),
    ({"seed": 1.5}, "seed=1.5 is invalid: must be an int or None"),
    ({"seed": "42"}, "seed='42' is invalid: must be an int or None"),
    ({"max_tokens": 0}, "max_tokens=0 is invalid: must be an int >= 1, or None"),
    ({"max_tokens": -3}, "max_tokens=-3 is invalid"),
    ({"max_tokens": 2.0}, "max_tokens=2.0 is invalid"),
    ({"logprobs": -1}, "logprobs=-1 is invalid: must be an int in [0, 20] or None"),
    ({"logprobs": MAX_LOGPROBS + 1}, f"logprobs={MAX_LOGPROBS + 1} is invalid: must be an int in \\[0, 20\\]"),
    ({"stop": ""}, "stop string '' in stop='' is invalid: must be a non-empty str"),
    ({"stop": ["ok", ""]}, "stop string '' in stop=\\['ok', ''\\] is invalid: must be a non-empty str"),
    ({"stop": ["ok", 3]}, "stop string 3 in stop=\\['ok', 3\\] is invalid"),
    ({"stop": 7}, "stop=7 is invalid: must be a str, a list of str, or None"),
    ({"stop_token_ids": [1, -2]}, "stop token id -2 in stop_token_ids=\\[1, -2\\] is invalid: must be an int >= 0"),
    ({"stop_token_ids": 5}, "stop_token_ids=5 is invalid: must be a list of int >= 0, or None"),
])
def test_invalid_values_are_named_with_what_is_allowed(kwargs, message):
    pattern = message if "\\" in message else re.escape(message)
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0}, {"temperature": 0.0}, {"top_p": 1}, {"top_p": 1e-9}, {"top_k": 1}, {"top_k": 0},
    {"top_k": -1}, {"min_p": 0}, {"min_p": 1}, {"seed": 0}, {"seed": -7}, {"max_tokens": 1},
    {"max_tokens": None}, {"logprobs": 0}, {"logprobs": MAX_LOGPROBS}, {"n": 1}, {"n": 2}, {"n": 64},
    {"presence_penalty": -2}, {"presence_penalty": 2.0}, {"frequency_penalty": -2.0}, {"frequency_penalty": 2},
    {"repetition_penalty": 1e-3}, {"repetition_penalty": 5}, {"logit_bias": {0: -100, 1: 100.0}},
    {"logit_bias": {}}, {"logit_bias": None},
])
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_bool_is_not_an_int():
    with pytest.raises(ValueError, match="max_tokens=True is invalid"):
        SamplingParams(max_tokens=True)
    with pytest.raises(ValueError, match="seed=False is invalid"):
        SamplingParams(seed=False)


def test_unknown_option_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="unexpected keyword argument 'best_of'"):
        SamplingParams(best_of=2)


def test_options_are_keyword_only():
    with pytest.raises(TypeError, match="positional argument"):
        SamplingParams(1, 0.5)


def test_top_k_minus_one_is_stored_as_zero():
    assert SamplingParams(top_k=-1).top_k == 0
    assert not SamplingParams(top_k=-1).top_k_enabled
    assert SamplingParams(top_k=5).top_k == 5 and SamplingParams(top_k=5).top_k_enabled


def test_stop_is_normalised_to_a_tuple():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=("a",)).stop == ("a",)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-6, True), (1e-5, False), (0.7, False)])
def test_greedy_below_vllm_epsilon(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy


def test_frozen_hashable_and_picklable():
    p = SamplingParams(stop=["x"], stop_token_ids=[1], seed=3)
    with pytest.raises(AttributeError):
        p.temperature = 0.0
    assert hash(p) == hash(SamplingParams(stop="x", stop_token_ids=(1,), seed=3))
    assert pickle.loads(pickle.dumps(p)) == p


def test_logit_bias_is_stored_as_sorted_int_float_pairs():
    p = SamplingParams(logit_bias={"12": -100, 3: 2.5, "007": 1})
    assert p.logit_bias == ((3, 2.5), (7, 1.0), (12, -100.0))
    assert all(type(t) is int and type(b) is float for t, b in p.logit_bias)
    assert SamplingParams(logit_bias=p.logit_bias) == p        # the stored form is a valid input (replace())
    assert SamplingParams(logit_bias=[(3, 2.5), ("12", -100), (7, 1)]) == p
    assert hash(p) == hash(SamplingParams(logit_bias={3: 2.5, 7: 1.0, 12: -100.0}))
    assert pickle.loads(pickle.dumps(p)) == p
    assert SamplingParams(logit_bias={}).logit_bias == () == SamplingParams(logit_bias=None).logit_bias


@pytest.mark.parametrize("kwargs, prompt, counts, adjusts", [
    ({}, False, False, False),
    ({"logit_bias": {1: 1.0}}, False, False, True),
    ({"presence_penalty": 0.5}, False, True, True),
    ({"frequency_penalty": -0.1}, False, True, True),
    ({"repetition_penalty": 1.2}, True, True, True),
    ({"repetition_penalty": 0.8, "temperature": 0}, True, True, True),
])
def test_what_the_penalties_read(kwargs, prompt, counts, adjusts):
    p = SamplingParams(**kwargs)
    assert (p.needs_prompt_tokens, p.counts_output_tokens, p.adjusts_logits) == (prompt, counts, adjusts)
