"""CUDA graph capture (marked gpu; skipped without CUDA; run by `python -m phaseflip.tools.gpu_check`).

At world size 1 the two layouts alias the same device and both are captured: replay equals eager,
park/restore cycles keep outputs identical and data pointers stable, and the manifest carries capture
ms and graph pool bytes."""
import pytest
import torch

from phaseflip import LLM, SamplingParams
from phaseflip.rank.messages import PoisonArena
from tests.engine.test_parity import parity_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no GPU on this machine")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
KW = dict(dtype="float32", device="cuda", max_num_seqs=8, max_num_batched_tokens=128,
          decode_buckets=(1, 2, 4, 8), prefill_buckets=(32, 64, 128))


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


def test_both_layouts_captured_and_replay_equals_eager(model):
    prompts = parity_prompts(384)[:6]
    with LLM(model=model, enforce_eager=True, **KW) as llm:
        eager = ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    with LLM(model=model, layouts=("pp", "tp"), park="always", **KW) as llm:
        m = llm.inspect()
        assert {s["layout"] for s in m["steps"]} == {"pp", "tp"}
        assert all(s["backend"] == "cuda" and s["capture_ms"] > 0 and s["pool_bytes"] is not None
                   for s in m["steps"])
        assert ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == eager
        llm.flip("tp")
        assert ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == eager
        assert llm.stats()["captures_after_boot"] == 0


def test_ten_park_restore_cycles_keep_outputs_and_pointers(model):
    prompts = parity_prompts(384)[:4]
    with LLM(model=model, layouts=("pp", "tp"), park="always", **KW) as llm:
        first = ids(llm.generate(prompts, GREEDY, use_tqdm=False))
        ptrs = llm.stats()["arena_ptrs"]
        for _ in range(10):
            llm.ranks.call(PoisonArena())
            llm.flip("tp" if llm.stats()["active_layout"] == "pp" else "pp")
            assert ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == first
        assert llm.stats()["arena_ptrs"] == ptrs
