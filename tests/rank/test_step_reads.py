"""A decode step reads the device once: the sampled ids. The GPU check counts host syncs on CUDA with
torch.cuda's sync debug mode; here a torch-function hook counts every host read (tolist, item, bool,
int, float, cpu, numpy, nonzero) while a decode step runs on the device side (filling and uploading
its inputs, replaying, reading its output). The CPU attention kernel reads its metadata on the host
(it runs there); the CUDA kernels take it on the device, so reads inside phaseflip/kernels are not
counted."""
import traceback

import pytest
from torch.overrides import TorchFunctionMode

from phaseflip import LLM, SamplingParams
from phaseflip.rank.messages import Phase
from phaseflip.rank.runner import LayoutRunner
from phaseflip.rank.sampler import Sampler

READS = {"tolist", "item", "__bool__", "__int__", "__float__", "cpu", "numpy", "nonzero"}


class CountReads(TorchFunctionMode):
    def __init__(self, reads: list):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            where = [f for f in traceback.extract_stack() if "/phaseflip/" in f.filename][-1]
            if "/phaseflip/kernels/" not in where.filename:
                self.reads.append(f"{func.__name__} at {where.filename.split('/phaseflip/')[-1]}:{where.lineno}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
                                    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1, max_tokens=9,
                                                   ignore_eos=True)], ids=["greedy", "top-k-top-p"])
def test_a_decode_step_reads_the_device_once(tiny_model_dir, monkeypatch, params):
    reads, decode_steps = [], []
    run, finish, execute = LayoutRunner._run, Sampler.finish_in_step, LayoutRunner.execute

    def counted(fn):
        def wrapper(*args, **kwargs):
            with CountReads(reads):
                return fn(*args, **kwargs)
        return wrapper

    def count_decodes(self, plan):
        if plan.phase is Phase.DECODE:
            decode_steps.append(plan)
        return execute(self, plan)

    def run_counted(self, plan, meta, variant=None):
        return (counted(run) if plan.phase is Phase.DECODE else run)(self, plan, meta, variant)
    monkeypatch.setattr(LayoutRunner, "_run", run_counted)
    monkeypatch.setattr(Sampler, "finish_in_step", counted(finish))
    monkeypatch.setattr(LayoutRunner, "execute", count_decodes)
    with LLM(model=str(tiny_model_dir("llama")), dtype="float32") as llm:
        out = llm.generate(["a prompt of a few words"], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 9 and len(decode_steps) == 8
    assert len(reads) == len(decode_steps), reads
    assert all(r.startswith("tolist at rank/sampler.py") for r in reads), reads
