"""The suite keeps to itself however and wherever it runs: its cache is a temp dir (never
the user's), and its engines run on the CPU unless a test asks for CUDA."""
from __future__ import annotations

import torch

from phaseflip import LLM
from phaseflip.cache import cache_dir
from phaseflip.tools.inspect_cmd import default_manifest_path


def test_the_suite_runs_on_a_private_cache(tmp_path_factory):
    """A test's boot once replaced the user's last-manifest.json (what `phaseflip inspect` shows)."""
    base = tmp_path_factory.getbasetemp()
    assert base in cache_dir().parents, f"the tests' cache is {cache_dir()}, not a temp dir"
    assert base in default_manifest_path().parents


def test_an_engine_in_the_suite_runs_on_the_cpu_where_cuda_is_available(tiny_model_dir, monkeypatch):
    """As on a GPU machine: device="auto" must not move a CPU test's engine onto the GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with LLM(model=str(tiny_model_dir("llama")), dtype="float32", max_model_len=64, max_num_seqs=2) as llm:
        assert llm.plan.device == "cpu"
