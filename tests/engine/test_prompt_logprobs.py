"""SamplingParams.prompt_logprobs (rank/prompt_logprobs.py): the logprob of each prompt token given the
ones before it, and the top-N there, equal to HF transformers' log-softmax of its own logits on the
same weights; the same over chunked prefills, a prefix-cache hit, two ranks in either layout."""
import pytest
import torch

from phaseflip import LLM, SamplingParams

PROMPTS = [[5 + (7 * i + 3 * j) % 300 for j in range(n)] for i, n in enumerate((1, 2, 19, 41))]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(model):
    """HF's log-softmax over the prompt's logits, per prompt: [len, vocab]."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0].log_softmax(-1) for p in PROMPTS]


def _run(model, top_n=0, **engine):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=top_n)
    with LLM(str(model), kv_cache_memory_gib=0.05, max_model_len=128, **engine) as llm:
        return [o.prompt_logprobs for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                        use_tqdm=False)]


def _check(got, reference, top_n=0):
    for prompt, lps, ref in zip(PROMPTS, got, reference, strict=True):
        _check_one(prompt, lps, ref, top_n)


def _check_one(prompt, lps, ref, top_n=0):
    assert len(lps) == len(prompt) and lps[0] is None
    for i, entry in enumerate(lps[1:]):
        token = prompt[i + 1]
        assert entry[token] == pytest.approx(ref[i, token].item(), abs=1e-4)
        if top_n:
            values, ids = ref[i].topk(top_n)
            assert set(entry) >= set(ids.tolist())
            assert len(entry) in (top_n, top_n + 1)


def test_prompt_logprobs_match_hf(model, reference):
    _check(_run(model), reference)


def test_top_n_prompt_logprobs_match_hf(model, reference):
    _check(_run(model, top_n=3), reference, top_n=3)


def test_chunked_prefill_and_a_prefix_cache_hit_give_every_position(model, reference):
    got = _run(model, max_num_batched_tokens=16)
    _check(got, reference)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    with LLM(str(model), kv_cache_memory_gib=0.05, max_model_len=128, enable_prefix_caching=True) as llm:
        first, again = (llm.generate([{"prompt_token_ids": PROMPTS[3]}], params, use_tqdm=False)[0]
                        for _ in range(2))
    assert first.prompt_logprobs == again.prompt_logprobs   # the cached prefix is computed again for them
    _check_one(PROMPTS[3], again.prompt_logprobs, reference[3])


@pytest.mark.parametrize("layout", ["pp", "tp"])
def test_two_ranks_give_one_ranks_prompt_logprobs(model, reference, layout):
    _check(_run(model, top_n=2, world_size=2, layouts=(layout,)), reference, top_n=2)


def test_prompt_logprobs_is_validated():
    with pytest.raises(ValueError, match=r"prompt_logprobs=-1 is invalid: must be an int in \[0, 20\]"):
        SamplingParams(prompt_logprobs=-1)
