"""Compiled steps (inductor, dynamic token dimension) on the CPU: the measured choice is recorded,
outputs match HF, and compiling/capturing writes nothing into the KV region. Slow: inductor compiles
for tens of seconds per role on 2 cores."""
import pytest
import torch

from phaseflip import LLM, SamplingParams
from tests.engine.test_parity import _prompts
from tests.models import compare_greedy, hf_greedy

pytestmark = pytest.mark.slow


def test_compiled_steps_match_hf_and_record_their_measurement(tiny_model_dir):
    d = tiny_model_dir("llama")
    prompts = _prompts(384)[:4]
    expected = hf_greedy(d, prompts, 16)
    with LLM(model=str(d), dtype="float32", compile="on", max_num_seqs=4, max_num_batched_tokens=128,
             decode_buckets=(1, 2, 4), prefill_buckets=(64, 128)) as llm:
        kv = llm.ranks.runtime.kv.buffer
        assert torch.count_nonzero(kv) == 0, "compiling and capturing wrote into the KV region"
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        m = llm.inspect()
    ok, _, msg = compare_greedy([o.outputs[0].token_ids for o in outs], expected)
    assert ok, msg
    for role, report in m["ranks"][0]["compile"]["pp"].items():
        assert report["choice"] in ("compiled", "eager")
        assert report["compiled_ms"] > 0 and report["eager_ms"] > 0 and report["compile_ms"] > 0, role
        assert {s["backend"] for s in m["steps"] if s["phase"] == role} == {report["choice"]}
