import pickle
import re

import pytest

from phaseflip.engine.sampling_params import MAX_LOGPROBS, SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, None, 16)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == ((), (), False, None)
    assert (p.include_stop_str_in_output, p.skip_special_tokens) == (False, True)
    assert not p.greedy and not p.top_k_enabled


@pytest.mark.parametrize("kwargs, message", [
    ({"n": 2}, "n=2 is invalid: only n=1 is supported"),
    ({"n": 0}, "n=0 is invalid: only n=1 is supported"),
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
    {"max_tokens": None}, {"logprobs": 0}, {"logprobs": MAX_LOGPROBS},
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
