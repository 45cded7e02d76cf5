"""bad_words (vLLM's): a word's last token is never drawn where the output ends with the tokens before it (a
one-token word never). The rule on a sequence's state, the words' token ids as vLLM finds them, and end to
end on the tiny llama (one rank, and two flipping every step)."""
from __future__ import annotations

import pytest
import torch

from phaseflip import LLM, SamplingParams
from phaseflip.engine.prompts import _with_bad_words
from phaseflip.rank.penalties import SeqPenalties
from tests.engine.test_llm import model_dir, one_thread  # noqa: F401  (fixtures: the tiny llama, one thread)

NEW = 16
ENGINE = dict(dtype="float32", max_num_seqs=4, max_model_len=96)


def banned(state: SeqPenalties) -> list[int]:
    row = torch.zeros(10)
    state.adjust(row)
    return torch.isinf(row).nonzero().flatten().tolist()


def test_a_words_last_token_is_banned_only_after_the_tokens_before_it():
    state = SeqPenalties(SamplingParams(bad_words_token_ids=[(7,), (3, 4, 5)]))
    assert banned(state) == [7]
    for t, after in ((3, [7]), (4, [5, 7]), (5, [7]), (3, [7]), (9, [7])):
        state.record(t)
        assert banned(state) == after, (t, after)


def test_the_words_ids_alone_and_after_a_space_as_vllm_finds_them(model_dir):  # noqa: F811
    from phaseflip.engine.checkpoint.tokenizer import load_tokenizer
    tok = load_tokenizer(model_dir)
    got = _with_bad_words(SamplingParams(bad_words=["fox", " dog"]), tok).bad_words_token_ids
    want = []
    for word in ("fox", "dog"):
        alone, spaced = tok.encode(word, add_special_tokens=False), tok.encode(" " + word, add_special_tokens=False)
        want += [tuple(alone)] + ([tuple(spaced)] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])
    assert got == tuple(want) and len(got) >= 2
    assert _with_bad_words(SamplingParams(), tok).bad_words_token_ids == ()


@pytest.fixture(scope="module")
def llm(model_dir):  # noqa: F811
    with LLM(model=str(model_dir), **ENGINE) as engine:
        yield engine


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, **kw)


def a_two_token_word(llm):
    """(prompt, greedy output, word) where the output's first two tokens decode to a word that encodes
    back to exactly them (so banning the word bans the second after the first)."""
    tok = llm.get_tokenizer()
    for prompt in ([t, t + 1, t + 2] for t in range(10, 300, 17)):
        out = llm.generate([prompt], greedy(), use_tqdm=False)[0].outputs[0].token_ids
        word = tok.decode(out[:2])
        if out[0] != out[1] and tuple(out[:2]) in _with_bad_words(greedy(bad_words=[word]), tok).bad_words_token_ids:
            return prompt, out, word
    pytest.fail("no greedy output starts with a two-token word that encodes back to itself: other prompts")


def test_a_two_token_word_keeps_its_first_token_and_loses_its_second(llm, model_dir):  # noqa: F811
    prompt, plain, word = a_two_token_word(llm)
    (out,) = llm.generate([prompt], greedy(bad_words=[word]), use_tqdm=False)
    got = out.outputs[0].token_ids
    assert got[0] == plain[0] and got[1] != plain[1], (plain, got)
    assert all(got[i:i + 2] != plain[:2] for i in range(len(got) - 1))
    with LLM(model=str(model_dir), **ENGINE, world_size=2, flip_every_steps=1) as two:
        assert two.generate([prompt], greedy(bad_words=[word]), use_tqdm=False)[0].outputs[0].token_ids == got


def test_a_one_token_word_never_comes_beside_a_sampled_batch(llm):
    tok = llm.get_tokenizer()
    prompt, plain, _ = a_two_token_word(llm)
    first = tok.decode(plain[:1])
    assert (plain[0],) in _with_bad_words(greedy(bad_words=[first]), tok).bad_words_token_ids
    params = [greedy(bad_words=[first]), SamplingParams(temperature=0.8, seed=3, max_tokens=NEW, ignore_eos=True)]
    out = llm.generate([prompt, prompt], params, use_tqdm=False)
    assert plain[0] not in out[0].outputs[0].token_ids
    assert out[1].outputs[0].token_ids == llm.generate([prompt], params[1], use_tqdm=False)[0].outputs[0].token_ids


def test_a_word_beyond_the_models_vocabulary_is_refused_naming_the_request(model_dir):  # noqa: F811
    from phaseflip.engine.checkpoint.tokenizer import load_tokenizer
    from phaseflip.engine.prompts import prepare_prompts
    tok = load_tokenizer(model_dir)
    word = next(tok.decode([t]) for t in range(300, len(tok))
                if min(tok.encode(tok.decode([t]).lstrip(), add_special_tokens=False) or [0]) >= 300)
    params = [SamplingParams(), SamplingParams(bad_words=[word])]
    with pytest.raises(ValueError, match=r"request 1: a bad word tokenizes to id 3\d\d, outside the model's "
                                         r"vocabulary \[0, 300\)"):
        prepare_prompts([[5], [6]], params, tok, vocab_size=300, max_model_len=96, max_tokens_in_pool=None)
