"""Every Triton kernel against its torch reference (phaseflip/kernels/selfcheck.py holds the cases, so the
GPU check runs the very same ones; conftest.py runs them in a subprocess, through Triton's interpreter on
the CPU), plus the dispatch rules: references on the CPU, no triton at import."""
import subprocess
import sys

import pytest
import torch

from phaseflip.kernels import dispatch, selfcheck
from phaseflip.kernels.reference import activation, norm, rotary
from tests.matrix import cells


# Triton's interpreter runs a case slowly on the CPU: by default every group, head size, page
# and split count of the attention matrix once (a decode and a prefill of each split form), every
# other kernel's cases all; the GPU check runs every case on the device.
INTERPRETED_BY_DEFAULT = {"attention/decode-g1-d64-page16-splits3", "attention/decode-g3-d128-page32-splits3",
                          "attention/decode-g4-d64-page16-splits1", "attention/decode-g8-d64-page32-splits3",
                          "attention/prefill-g1-d64-page16-splits1", "attention/prefill-g4-d64-page32-splits2"}


def _by_default(name: str) -> bool:
    return not name.startswith(("attention/decode-g", "attention/prefill-g")) or name in INTERPRETED_BY_DEFAULT


@pytest.mark.parametrize("name", cells(list(selfcheck.CASES), default=_by_default,
                                       why="another case of the attention matrix runs its group, head size, "
                                           "page and split count"))
def test_kernel_matches_reference(name, kernel_results):
    result = kernel_results[name]
    assert result["ok"], result["error"]


def test_cases_cover_the_issue_matrix():
    decode = [n for n in selfcheck.CASES if n.startswith("attention/decode-")]
    for part in ("g1-", "g3-", "g4-", "g8-", "d64-", "d128-", "page16-", "page32-", "splits1", "splits3"):
        assert any(part in n for n in decode), part
        assert any(part in n for n in decode if n in INTERPRETED_BY_DEFAULT), part
    assert INTERPRETED_BY_DEFAULT <= set(selfcheck.CASES)
    kernels = {n.split("/")[0] for n in selfcheck.CASES}
    assert kernels == {"attention", "kv_store", "rms_norm", "add_rms_norm", "rotary", "silu_and_mul", "quant", "moe"}


def test_run_cases_records_failures_and_goes_on(monkeypatch):
    def broken(device):
        raise AssertionError("wrong")
    monkeypatch.setitem(selfcheck.CASES, "x/broken", broken)
    monkeypatch.setitem(selfcheck.CASES, "x/fine", lambda device: 0.5)
    got = selfcheck.run_cases("cpu", ["x/broken", "x/fine"])
    assert got == [dict(name="x/broken", ok=False, error="AssertionError: wrong"),
                   dict(name="x/fine", ok=True, max_abs_err=0.5)]


def test_split_count_comes_from_shapes_only():
    from phaseflip.kernels.triton.attention import choose_num_splits
    assert choose_num_splits(num_programs=1000, max_context=131072, num_sms=132) == 1  # device already full
    assert choose_num_splits(num_programs=8, max_context=200, num_sms=132) == 1      # context too short
    assert choose_num_splits(num_programs=8, max_context=131072, num_sms=132) == 16  # long decode at batch 1
    assert choose_num_splits(num_programs=64, max_context=4096, num_sms=132) == 5


def test_dispatch_runs_the_references_on_cpu():
    g = torch.Generator().manual_seed(0)
    x, r, w = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g), torch.rand(8, generator=g)
    cs = rotary.cos_sin_table(8, 16, 10000.0)[torch.tensor([0, 3, 7])]
    assert torch.equal(dispatch.rms_norm(x, w, 1e-6), norm.rms_norm(x, w, 1e-6))
    for a, b in zip(dispatch.add_rms_norm(x, r, w, 1e-6), norm.add_rms_norm(x, r, w, 1e-6)):
        assert torch.equal(a, b)
    assert torch.equal(dispatch.apply_rotary(x.view(3, 1, 8), cs), rotary.apply_rotary(x.view(3, 1, 8), cs))
    assert torch.equal(dispatch.silu_and_mul(x), activation.silu_and_mul(x))


def test_custom_ops_have_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x, w = torch.empty(5, 64, dtype=torch.bfloat16), torch.empty(64, dtype=torch.bfloat16)
        assert torch.ops.phaseflip.rms_norm(x, w, 1e-6).shape == (5, 64)
        out, res = torch.ops.phaseflip.add_rms_norm(x, x, w, 1e-6)
        assert out.shape == res.shape == (5, 64) and res.dtype == torch.bfloat16
        assert torch.ops.phaseflip.apply_rotary(x.view(5, 2, 32), torch.empty(5, 32)).shape == (5, 2, 32)
        assert torch.ops.phaseflip.silu_and_mul(x).shape == (5, 32)


def test_importing_the_model_maths_imports_no_triton():
    code = ("import sys; import phaseflip.rank.forward, phaseflip.kernels.dispatch, "
            "phaseflip.kernels.selfcheck; assert 'triton' not in sys.modules, 'triton imported at import'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
