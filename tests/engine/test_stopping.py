"""Stop strings are found by decoding a suffix of the output each step: the result must be exactly what
decoding the whole output each step gives, for stop strings spanning tokens, multi-byte characters and
outputs far longer than the window."""
import random

import pytest

from phaseflip.engine import stopping
from phaseflip.engine.requests import Sequence
from phaseflip.engine.sampling_params import SamplingParams
from phaseflip.engine.checkpoint.tokenizer import load_tokenizer

TEXT = ("Le café était fermé, so we walked on — past the 東京 station — until the rain stopped. "
        "Then, at last: halt here? No: the story goes on and on, the end. ") * 6


def first_stop_step(tok, ids, params, full_decode: bool):
    seq = Sequence(seq_id=0, request_id="0", prompt_token_ids=[1], params=params)
    for step, t in enumerate(ids):
        seq.output_token_ids.append(t)
        if full_decode:
            text = tok.decode(seq.output_token_ids)
            if any(s in text for s in params.stop):
                return step
        elif stopping.check_stop(seq, tok, frozenset(), 10**6) is not None:
            return step
    return None


@pytest.mark.parametrize("stop", ["STOP", "京 st!", "é, s.", "the end!", "rain stopped; then"])
def test_suffix_decode_stops_where_a_full_decode_does(default_model_dir, stop):
    tok = load_tokenizer(default_model_dir)
    rng = random.Random(0)
    words = TEXT.split(" ")
    for trial in range(4):
        text = " ".join(rng.choice(words) for _ in range(300)) + " " + stop + " tail"
        ids = tok.encode(text, add_special_tokens=False)
        params = SamplingParams(max_tokens=None, stop=[stop], ignore_eos=True)
        expected = first_stop_step(tok, ids, params, full_decode=True)
        assert expected is not None and expected > 4 * len(stop) + stopping.TAIL_MARGIN
        assert first_stop_step(tok, ids, params, full_decode=False) == expected, (trial, stop)


def test_before_min_tokens_only_the_lengths_end_a_sequence(default_model_dir):
    """vLLM's rule: EOS, stop tokens and stop strings are not checked before min_tokens; max_tokens is."""
    tok = load_tokenizer(default_model_dir)
    ids = tok.encode("halt here, halt there, and on", add_special_tokens=False)
    eos = frozenset({ids[1]})
    for min_tokens in (0, 5):
        params = SamplingParams(max_tokens=len(ids), stop=["halt"], stop_token_ids=[ids[1]], min_tokens=min_tokens)
        seq = Sequence(seq_id=0, request_id="0", prompt_token_ids=[1], params=params)
        steps = []
        for step, t in enumerate(ids):
            seq.output_token_ids.append(t)
            if stopping.check_stop(seq, tok, eos, 10**6) is not None:
                steps.append(step)
        # the first token is "halt", the second EOS and a stop token: at once without min_tokens, else
        # not before the 5th token (step 4)
        assert (steps[0] >= 4) if min_tokens else (steps[0] <= 1), (min_tokens, steps)
    short = SamplingParams(max_tokens=3, min_tokens=3)
    seq = Sequence(seq_id=0, request_id="0", prompt_token_ids=[1], params=short)
    seq.output_token_ids.extend(ids[:3])
    assert stopping.check_stop(seq, tok, eos, 10**6).finish_reason == "length"
