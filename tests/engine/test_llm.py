"""The offline API (LLM.generate / chat / stats / shutdown) end to end on a tiny random Llama.

Bad input is refused up front with a message naming the bad value, what is allowed and (in a list) the
request's index, and nothing runs; seeded sampling reproduces whatever shares the batch; EOS, stop
tokens, stop strings, max_tokens and max_model_len end a request with vLLM's finish/stop reasons;
outputs are vLLM-shaped and in input order; an interrupt leaves the engine usable. One greedy chat on
the real SmolLM2-135M-Instruct checks the whole path answers sensibly.
"""
from __future__ import annotations

import dataclasses

import pytest

from phaseflip import LLM, SamplingParams

MAX_MODEL_LEN = 96
EOS_ID = 2  # <|im_end|>: the tiny models' eos_token_id and the tokenizer's eos token
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=123, max_tokens=20)
PROMPTS = ["The quick brown fox", "Hello, world!", "What is 2 + 2?", "A large language model"]
# Greedy continuations of these end in EOS on the tiny llama (found by a search; the first one that
# still does is used, so a regenerated tiny model only needs one of them to keep working).
EOS_CANDIDATES = ["jugs dozen five", "dog dozen", [44, 382, 241, 104], [81, 207, 348, 223, 205, 368, 303, 372]]


def make_llm(model_dir, **kw) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", max_num_seqs=8, max_model_len=MAX_MODEL_LEN, **kw)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine spinning threads
    make every step many times slower."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    with make_llm(model_dir) as engine:
        yield engine


@pytest.fixture(scope="module")
def llm_chunk16(model_dir):
    with make_llm(model_dir, max_num_batched_tokens=16) as engine:
        yield engine


def gen(llm, prompts, params=GREEDY):
    return llm.generate(prompts, params, use_tqdm=False)


def ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_blocks_free(llm):
    stats = llm.stats()
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"], "KV blocks leaked"


# -- 1. bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("prompts, error, message", [
    ("", ValueError, r"prompt 0 is empty"),
    ([[]], ValueError, r"prompt 0 is empty \(0 tokens\)"),
    ([[5, -1, 7]], ValueError, r"prompt 0: token id -1 is outside the vocabulary \[0, 384\)"),
    ([[5, 384]], ValueError, r"prompt 0: token id 384 is outside the vocabulary \[0, 384\)"),
    ([[5] * 200], ValueError, r"prompt 0 has 200 tokens, but max_model_len=96 .*shorter than 96 tokens"),
    ([{"text": "hi"}], ValueError, r"prompt 0: a dict prompt needs 'prompt' or 'prompt_token_ids'"),
    ([3.5], TypeError, r"prompt 0 must be a str or a list of int token ids; got float"),
])
def test_bad_prompt_is_refused_naming_the_value(llm, prompts, error, message):
    with pytest.raises(error, match=message):
        gen(llm, prompts)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), r"temperature=-0.5 is invalid: must be a finite number >= 0"),
    (dict(top_p=0.0), r"top_p=0.0 is invalid: must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p=1.5 is invalid: must be in \(0, 1\]"),
    (dict(top_k=-2), r"top_k=-2 is invalid: must be an int >= 1, or 0 or -1 to disable"),
    (dict(min_p=-0.1), r"min_p=-0.1 is invalid: must be in \[0, 1\]"),
    (dict(min_p=1.5), r"min_p=1.5 is invalid: must be in \[0, 1\]"),
    (dict(max_tokens=0), r"max_tokens=0 is invalid: must be an int >= 1"),
    (dict(truncate_prompt_tokens=0), r"truncate_prompt_tokens=0 is invalid: must be an int >= 1 .*-1 .*None"),
])
def test_bad_sampling_params_are_refused_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_prompt_larger_than_the_kv_pool_is_refused(model_dir):
    with make_llm(model_dir, num_kv_blocks=2, block_size=16) as small:
        with pytest.raises(ValueError, match=r"prompt 1 has 40 tokens, but the KV pool holds only 32 tokens"):
            gen(small, [[5, 6], [5] * 40])
        out = gen(small, [[5] * 31], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
        assert out[0].outputs[0].finish_reason == "length"  # the pool is its max model length
        assert_all_blocks_free(small)


def test_max_model_len_above_the_model_is_refused(model_dir):
    with pytest.raises(ValueError, match=r"max_model_len=257 is larger than the model's maximum 256"):
        LLM(model=str(model_dir), dtype="float32", max_model_len=257)


def test_unknown_engine_option_is_a_type_error_naming_it(model_dir):
    with pytest.raises(TypeError, match=r"unknown engine option\(s\) max_num_sequences"):
        LLM(model=str(model_dir), max_num_sequences=4)


def test_sampling_params_list_of_the_wrong_length_is_refused(llm):
    with pytest.raises(ValueError, match=r"got 3 SamplingParams for 2 prompts"):
        gen(llm, ["a", "b"], [GREEDY] * 3)
    with pytest.raises(TypeError, match=r"sampling_params\[1\] is a dict, not a SamplingParams"):
        gen(llm, ["a", "b"], [GREEDY, {"temperature": 0}])


@pytest.mark.parametrize("bad, message", [
    ([], r"prompt 2 is empty"),
    ([7, 999], r"prompt 2: token id 999 is outside the vocabulary"),
    ([7] * 100, r"prompt 2 has 100 tokens, but max_model_len=96"),
])
def test_a_bad_request_in_a_list_names_its_index_and_nothing_runs(llm, bad, message):
    before = ids(gen(llm, PROMPTS[:2]))
    steps = llm.stats()["steps"]
    with pytest.raises(ValueError, match=message):
        gen(llm, [PROMPTS[0], [5, 6, 7], bad, PROMPTS[1]])
    assert llm.stats()["steps"] == steps, "a request ran although the batch was refused"
    assert_all_blocks_free(llm)
    assert ids(gen(llm, PROMPTS[:2])) == before


# -- 2. seeded sampling -----------------------------------------------------------------------------

def test_seeded_sampling_does_not_depend_on_the_batch(llm, llm_chunk16):
    target = PROMPTS[0]
    alone = ids(gen(llm, [target], SEEDED))[0]
    assert len(alone) == SEEDED.max_tokens
    others = [PROMPTS[1], [9, 8, 7, 6, 5] * 7, PROMPTS[2], PROMPTS[3]]
    other_params = [SamplingParams(temperature=1.0, seed=7, max_tokens=25),
                    SamplingParams(temperature=0.0, max_tokens=9),
                    SamplingParams(temperature=0.7, top_k=20, max_tokens=30),   # unseeded
                    SamplingParams(temperature=1.2, min_p=0.05, max_tokens=5)]  # unseeded
    for position in (0, 2, 4):
        prompts = others[:position] + [target] + others[position:]
        params = other_params[:position] + [SEEDED] + other_params[position:]
        for engine in (llm, llm_chunk16):
            got = ids(gen(engine, prompts, params))[position]
            assert got == alone, f"seeded request at position {position} diverged"
    # A second, identical request in the same batch is its own generator, seeded the same.
    assert ids(gen(llm, [target, target], SEEDED)) == [alone, alone]


def test_seeded_sampling_survives_preemption(llm, model_dir):
    prompts = [[30 + i] * (5 + 9 * i) for i in range(6)]
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_tokens=30, ignore_eos=True)
              for i in range(6)]
    expected = ids(gen(llm, prompts, params))
    with make_llm(model_dir, num_kv_blocks=8) as small:  # 128 tokens for 6 sequences of up to 80
        assert ids(gen(small, prompts, params)) == expected
        stats = small.stats()
    assert stats["num_preemptions"] > 0, "the small pool was meant to force preemption"
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"]


def test_different_seeds_give_different_samples(llm):
    outs = [ids(gen(llm, [PROMPTS[0]], SamplingParams(temperature=1.0, seed=s, max_tokens=20)))[0]
            for s in (1, 2, 3)]
    assert len({tuple(o) for o in outs}) == 3, outs
    greedy = ids(gen(llm, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=20)))[0]
    assert any(o != greedy for o in outs)


def test_unseeded_batch_reproduces_on_fresh_engines_with_the_same_seed(model_dir):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16)
    runs = []
    for engine_seed in (5, 5, 6):
        with make_llm(model_dir, seed=engine_seed) as engine:
            runs.append(ids(gen(engine, PROMPTS, params)))
    assert runs[0] == runs[1]
    assert runs[0] != runs[2], "the engine seed should change unseeded samples"
    assert len({tuple(r) for r in runs[0]}) == len(PROMPTS)


# -- 3. stops ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def eos_prompt(llm):
    for prompt in EOS_CANDIDATES:
        out = gen(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]
        if out.finish_reason == "stop":
            return prompt, out
    pytest.fail("no EOS_CANDIDATES prompt ends in EOS on the tiny llama any more: search for a new one")


def test_eos_stops_and_ignore_eos_runs_to_max_tokens(llm, eos_prompt):
    prompt, out = eos_prompt
    assert out.token_ids[-1] == EOS_ID and EOS_ID not in out.token_ids[:-1]
    assert out.stop_reason is None
    assert "<|im_end|>" not in out.text  # special tokens are skipped in the text
    raw = gen(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=40, skip_special_tokens=False))
    assert raw[0].outputs[0].text == out.text, "the EOS that ended a request is never in its text"
    raw = gen(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=40, skip_special_tokens=False,
                                            include_stop_str_in_output=True))
    assert raw[0].outputs[0].text.endswith("<|im_end|>")
    n = len(out.token_ids)
    cont = gen(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=n + 5, ignore_eos=True))[0].outputs[0]
    assert cont.finish_reason == "length" and len(cont.token_ids) == n + 5
    assert cont.token_ids[:n] == out.token_ids


def test_stop_token_ids_stop_with_that_id(llm):
    full = ids(gen(llm, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=20)))[0]
    tok = llm.get_tokenizer()
    # from the 7th token on, the first that first occurs there and adds text that shows
    first = next(i for i in range(6, len(full))
                 if full.index(full[i]) == i and shown(tok, full[:i + 1]) != shown(tok, full[:i]))
    stop_id = full[first]
    never = next(t for t in range(3, 384) if t not in full)
    out = gen(llm, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=20,
                                                  stop_token_ids=[never, stop_id]))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_id
    assert out.token_ids == full[:first + 1] and out.token_ids[-1] == stop_id
    # As in vLLM, the stop token stays in token_ids but not in the text, unless asked for.
    assert out.text == shown(tok, full[:first])
    kept = gen(llm, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_id],
                                                   include_stop_str_in_output=True))[0].outputs[0]
    assert kept.token_ids == out.token_ids and kept.text == shown(tok, full[:first + 1])
    assert kept.text != out.text


def shown(tok, token_ids: list[int]) -> str:
    """The text of token_ids as an output shows it: without a character its last tokens left incomplete
    (vLLM's detokenizer never emits one)."""
    return tok.decode(token_ids).rstrip("\ufffd")


def _boundary(llm, token_ids: list[int]) -> tuple[int, int]:
    """(k, b): a token boundary (the text of token_ids[:k] is b characters long and a prefix of the whole
    text) with printable characters either side, whose two characters first occur there."""
    tok = llm.get_tokenizer()
    full = tok.decode(token_ids)
    for k in range(2, len(token_ids) - 1):
        head, head_next = tok.decode(token_ids[:k]), tok.decode(token_ids[:k + 1])
        b = len(head)
        if not (full.startswith(head) and full.startswith(head_next) and len(head_next) > b > 0):
            continue
        stop = full[b - 1:b + 1]
        if stop.isprintable() and "\ufffd" not in stop and full.find(stop) == b - 1:
            return k, b
    pytest.fail(f"no usable token boundary in {full!r}")


def test_stop_string_across_a_token_boundary_cuts_the_text(llm):
    prompt = PROMPTS[2]
    params = dict(temperature=0.0, max_tokens=30)
    greedy = gen(llm, [prompt], SamplingParams(**params))[0].outputs[0]
    full = greedy.text
    k, b = _boundary(llm, greedy.token_ids)
    stop = full[b - 1:b + 1]  # last char of token k-1, first char of token k
    for include in (False, True):
        out = gen(llm, [prompt], SamplingParams(**params, stop=["\u00a7never\u00a7", stop],
                                                include_stop_str_in_output=include))[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == (full[:b + 1] if include else full[:b - 1])
        assert out.token_ids == greedy.token_ids[:k + 1], "the tokens that made the stop string are kept"


def test_max_tokens_ends_with_length(llm):
    for n in (1, 7):
        outs = gen(llm, PROMPTS, SamplingParams(temperature=0.8, seed=1, max_tokens=n, ignore_eos=True))
        assert [(o.outputs[0].finish_reason, len(o.outputs[0].token_ids)) for o in outs] == [("length", n)] * 4


def test_prompt_near_max_model_len_ends_with_length_at_max_model_len(llm):
    for prompt in ([11, 12, 13, 14] * 23, [11] * (MAX_MODEL_LEN - 1)):  # 4 and 1 tokens of room
        for max_tokens in (None, 50):
            out = gen(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            c = out[0].outputs[0]
            assert c.finish_reason == "length"
            assert len(prompt) + len(c.token_ids) == MAX_MODEL_LEN
    assert_all_blocks_free(llm)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    long = [11 + i % 50 for i in range(MAX_MODEL_LEN + 40)]   # longer than the context: refused whole
    six = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    cut = gen(llm, [long], dataclasses.replace(six, truncate_prompt_tokens=30))[0]
    alone = gen(llm, [long[-30:]], six)[0]
    assert cut.prompt_token_ids == long[-30:] and cut.outputs[0].token_ids == alone.outputs[0].token_ids
    most = gen(llm, [long], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True,
                                           truncate_prompt_tokens=-1))[0]
    assert most.prompt_token_ids == long[-(MAX_MODEL_LEN - 1):] and len(most.outputs[0].token_ids) == 1
    assert gen(llm, [[11, 12, 13]], dataclasses.replace(six, truncate_prompt_tokens=30))[0].prompt_token_ids == \
        [11, 12, 13]
    text = gen(llm, ["The quick brown fox " * 30], dataclasses.replace(six, truncate_prompt_tokens=30))[0]
    assert len(text.prompt_token_ids) == 30   # reported as the text that ran, not the text given
    assert text.prompt == llm.get_tokenizer().decode(text.prompt_token_ids, skip_special_tokens=False)
    chat = llm.chat([{"role": "user", "content": "hi " * 60}], dataclasses.replace(six, truncate_prompt_tokens=20),
                    use_tqdm=False)[0]
    assert len(chat.prompt_token_ids) == 20
    assert chat.prompt == llm.get_tokenizer().decode(chat.prompt_token_ids, skip_special_tokens=False)
    with pytest.raises(ValueError, match=f"prompt 0 has {len(long)} tokens"):
        gen(llm, [long], six)
    assert_all_blocks_free(llm)


# -- 4. logprobs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_per_token(llm, temperature):
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=10, logprobs=3)
    for out in gen(llm, PROMPTS, params):
        c = out.outputs[0]
        assert len(c.logprobs) == len(c.token_ids)
        for token, top in zip(c.token_ids, c.logprobs):
            assert token in top and 3 <= len(top) <= 4
            assert all(v <= 0 for v in top.values())
            if temperature == 0:
                assert top[token] == max(top.values())
        assert c.cumulative_logprob == pytest.approx(sum(d[t] for d, t in zip(c.logprobs, c.token_ids)))
        for top in c.logprobs:   # vLLM's Logprob fields too: rank 1.. for the top 3, None below them
            assert [v.rank for v in top.values()][:3] == [1, 2, 3] and all(v.logprob == v for v in top.values())
            assert len(top) == 3 or list(top.values())[3].rank is None
    assert gen(llm, PROMPTS[:1])[0].outputs[0].logprobs is None
    prompt = gen(llm, PROMPTS[:1], SamplingParams(max_tokens=1, prompt_logprobs=1))[0].prompt_logprobs
    assert prompt[0] is None and all(list(d.values())[0].rank == 1 for d in prompt[1:])


# -- 5. output shape --------------------------------------------------------------------------------

def test_request_output_fields(llm):
    tok = llm.get_tokenizer()
    prompts = [PROMPTS[0], [5, 6, 7], {"prompt": PROMPTS[1]}, {"prompt_token_ids": [8, 9]}]
    outs = gen(llm, prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert [o.prompt for o in outs] == [PROMPTS[0], None, PROMPTS[1], None]
    assert [o.prompt_token_ids for o in outs] == [tok.encode(PROMPTS[0]), [5, 6, 7], tok.encode(PROMPTS[1]), [8, 9]]
    assert len({o.request_id for o in outs}) == 4 and all(isinstance(o.request_id, str) for o in outs)
    for o in outs:
        c = o.outputs[0]
        assert o.finished and len(o.outputs) == 1
        assert c.finish_reason == "length" and len(c.token_ids) == 5
        assert c.text == shown(tok, c.token_ids)
        assert o.metrics.time_to_first_token > 0
        assert len(o.metrics.token_times) == len(c.token_ids)
        assert list(o.metrics.token_times) == sorted(o.metrics.token_times)


def test_outputs_come_back_in_input_order(llm):
    # Different lengths finish in a different order from the input.
    lengths = [30, 3, 17, 1, 9]
    prompts = [[10 + i, 20 + i] for i in range(len(lengths))]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = gen(llm, prompts, params)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    assert [int(o.request_id) for o in outs] == sorted(int(o.request_id) for o in outs)
    alone = [ids(gen(llm, [p], sp))[0] for p, sp in zip(prompts, params)]
    assert ids(outs) == alone


def test_single_str_gives_one_output_and_empty_list_gives_none(llm):
    steps = llm.stats()["steps"]
    assert gen(llm, []) == []
    assert llm.stats()["steps"] == steps
    outs = gen(llm, PROMPTS[0])
    assert len(outs) == 1 and outs[0].prompt == PROMPTS[0]
    assert ids(outs) == ids(gen(llm, [PROMPTS[0]]))
    assert ids(gen(llm, [5, 6, 7])) == ids(gen(llm, [[5, 6, 7]]))  # a flat id list is one prompt


# -- 6. chat ----------------------------------------------------------------------------------------

def test_chat_one_and_many_conversations(llm):
    tok = llm.get_tokenizer()
    one = [{"role": "user", "content": "Hello, world!"}]
    two = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    outs = llm.chat(one, GREEDY, use_tqdm=False)
    assert len(outs) == 1
    rendered = tok.apply_chat_template(one, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert outs[0].prompt == rendered
    assert outs[0].prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    both = llm.chat([one, two], GREEDY, use_tqdm=False)
    assert [o.prompt for o in both] == [rendered, tok.apply_chat_template(two, add_generation_prompt=True)]
    assert ids(both)[0] == ids(outs)[0]
    assert ids(both)[1] == ids(gen(llm, [both[1].prompt_token_ids]))[0]


def test_chat_takes_text_parts_and_vllms_template_options(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello,"}, {"type": "text", "text": "world"}]}]
    joined = [{"role": "user", "content": "Hello,\nworld"}]
    assert [o.prompt for o in llm.chat(parts, GREEDY, use_tqdm=False)] == \
        [o.prompt for o in llm.chat(joined, GREEDY, use_tqdm=False)]
    going = joined + [{"role": "assistant", "content": "Hi! The"}]
    out = llm.chat(going, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt.endswith("Hi! The")
    custom = "{% for m in messages %}{{ greeting }} {{ m['content'] }}|{% endfor %}"
    out = llm.chat(joined, GREEDY, use_tqdm=False, chat_template=custom, chat_template_kwargs={"greeting": "Yo"})[0]
    assert out.prompt == "Yo Hello,\nworld|"


def test_smollm2_chat_knows_the_capital_of_france(default_model_dir):
    with LLM(model=str(default_model_dir), dtype="float32", max_model_len=256, max_num_seqs=2) as engine:
        out = engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                          SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text, out[0].outputs[0].text


# -- 7. lifetime ------------------------------------------------------------------------------------

def test_context_manager_and_shutdown(model_dir):
    with make_llm(model_dir) as engine:
        assert len(gen(engine, PROMPTS[:1])) == 1
    with pytest.raises(RuntimeError, match=r"shut down; create a new one"):
        gen(engine, PROMPTS[:1])
    with pytest.raises(RuntimeError, match=r"shut down"):
        engine.chat([{"role": "user", "content": "hi"}], use_tqdm=False)


@pytest.mark.parametrize("hook", ["step", "execute"])  # between steps / with a step in flight
@pytest.mark.parametrize("interrupt_at_call", [1, 4])
def test_keyboard_interrupt_propagates_and_leaves_the_engine_usable(llm, monkeypatch, hook, interrupt_at_call):
    prompts = PROMPTS + [[3, 4, 5] * 10]
    before = ids(gen(llm, prompts))
    original, calls = getattr(llm.core, hook), []

    def interrupting(*args):
        calls.append(1)
        if len(calls) == interrupt_at_call:
            raise KeyboardInterrupt
        return original(*args)

    monkeypatch.setattr(llm.core, hook, interrupting)
    with pytest.raises(KeyboardInterrupt):
        gen(llm, prompts)
    assert len(calls) == interrupt_at_call
    assert_all_blocks_free(llm)
    assert not llm.core.has_unfinished()
    assert ids(gen(llm, prompts)) == before
    assert_all_blocks_free(llm)


def test_an_interrupted_step_does_not_leak_sampler_state(model_dir):
    with make_llm(model_dir) as engine:
        sampler = engine.ranks.runtime.sampler  # the in-process rank's per-sequence sampling state
        gen(engine, PROMPTS[:2])                # its two sequences are dropped by the next plan
        execute = engine.core.execute

        def interrupt(plan):
            raise KeyboardInterrupt  # before the plan (which carries those two ids) reaches the rank

        engine.core.execute = interrupt
        with pytest.raises(KeyboardInterrupt):
            gen(engine, PROMPTS[:2])
        engine.core.execute = execute
        for _ in range(2):
            last = gen(engine, PROMPTS[:2])
        held = {seq_id for seq_id in range(int(last[-1].request_id) + 1) if seq_id in sampler}
        assert held <= {int(o.request_id) for o in last}, f"stale sampler state for seq ids {sorted(held)}"


# -- 8. determinism ---------------------------------------------------------------------------------

def test_greedy_batch_is_deterministic_and_independent_of_its_neighbours(llm, llm_chunk16):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    batch = PROMPTS + [[7] * 40, [100, 200, 300]]
    first = ids(gen(llm, batch, params))
    assert ids(gen(llm, batch, params)) == first
    alone = [ids(gen(llm, [p], params))[0] for p in batch]
    assert first == alone
    assert ids(gen(llm, batch[::-1], params)) == first[::-1]
    assert ids(gen(llm_chunk16, batch, params)) == first
