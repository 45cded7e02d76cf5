"""generation_config.json (engine/checkpoint/generation_config.py): its sampling defaults apply where a call
or a request leaves a field unset (vLLM's behaviour), its eos ids end generation beside the tokenizer's,
and a bad file is refused by name."""
import json
import shutil

import pytest

from phaseflip import LLM, SamplingParams
from phaseflip.engine.checkpoint.generation_config import GenerationDefaults, load_generation_defaults
from phaseflip.engine.checkpoint.loader import CheckpointError
from phaseflip.serve.protocol import ChatCompletionRequest, CompletionRequest

PROMPTS = [[5, 17, 42, 9], [100, 3, 77]]


def _with_generation_config(src, dst, **fields):
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps(fields))
    return dst


def test_the_file_reads_into_sampling_defaults_and_eos_ids(tmp_path):
    tmp_path.joinpath("generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 64,
         "repetition_penalty": 1.05, "eos_token_id": [2, 7], "bos_token_id": 1}))
    d = load_generation_defaults(tmp_path)
    assert d.sampling == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05,
                          "max_tokens": 64}
    assert d.eos_token_ids == (2, 7) and d.source.endswith("generation_config.json")
    assert load_generation_defaults(tmp_path / "nowhere") == GenerationDefaults()


@pytest.mark.parametrize("text, named", [("[1, 2]", "expected a JSON object"), ("{oops", "as JSON"),
                                         ('{"temperature": "hot"}', "'temperature' must be a number"),
                                         ('{"eos_token_id": "2"}', "'eos_token_id' must be an int")])
def test_a_bad_file_is_refused_by_name(tmp_path, text, named):
    tmp_path.joinpath("generation_config.json").write_text(text)
    with pytest.raises(CheckpointError, match=named):
        load_generation_defaults(tmp_path)


def test_a_call_without_params_takes_the_defaults_and_its_eos_ids_stop(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    with LLM(str(src)) as llm:
        greedy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6,
                                                                                         ignore_eos=True), use_tqdm=False)]
    stop = greedy[0][3]   # the 4th token of the first prompt's greedy run: an eos id of the file's
    model = _with_generation_config(src, tmp_path / "m", temperature=0.0, max_new_tokens=6, eos_token_id=[2, stop])
    with LLM(str(model)) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=6)
        got = [o.outputs[0] for o in llm.generate(PROMPTS, use_tqdm=False)]
        explicit = llm.generate(PROMPTS, SamplingParams(max_tokens=2, ignore_eos=True, seed=1), use_tqdm=False)
    first = greedy[0].index(stop) + 1
    assert got[0].token_ids == greedy[0][:first] and got[0].finish_reason == "stop"
    if stop not in greedy[1]:
        assert got[1].token_ids == greedy[1] and got[1].finish_reason == "length"
    assert [len(o.outputs[0].token_ids) for o in explicit] == [2, 2]   # explicit params: no defaults


def test_a_request_leaving_a_field_unset_gets_the_default():
    defaults = GenerationDefaults({"temperature": 0.3, "top_k": 5, "max_tokens": 7})
    p = CompletionRequest(prompt="hi").sampling_params(defaults)
    assert (p.temperature, p.top_k, p.max_tokens, p.top_p) == (0.3, 5, 7, 1.0)
    p = CompletionRequest(prompt="hi", temperature=1.0, max_tokens=3).sampling_params(defaults)
    assert (p.temperature, p.top_k, p.max_tokens) == (1.0, 5, 3)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=4)
    assert chat.sampling_params(defaults).max_tokens == 4
    assert CompletionRequest(prompt="hi").sampling_params().temperature == 1.0   # no file: OpenAI's defaults
