"""The CPU kernels (kernels/cpu/library.py): built on this machine, the few-rows product against F.linear,
its refusals, the build reused (the decode attention kernel: tests/kernels/test_attention.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from phaseflip.cache import cache_dir
from phaseflip.kernels.cpu import library


@pytest.fixture(scope="module")
def op(cpu_kernels):
    return cpu_kernels.few_rows_op()


@pytest.mark.parametrize("dtype", library.DTYPES)
@pytest.mark.parametrize("k", [64, 576, 83])           # whole lanes, SmolLM2's width, a tail
def test_kernel_gives_f_linear_answer(op, dtype, k):
    g = torch.Generator().manual_seed(k)
    wide = torch.randn(300, k + 24, generator=g).to(dtype)
    for w in (wide[:, :k].contiguous(), wide[:, :k]):    # rows packed, and a view whose rows lie apart
        for m in library.CHECK_ROWS:
            packed = torch.randn(m, k, generator=g).to(dtype)
            apart = torch.randn(m, k + 5, generator=g).to(dtype)[:, 3:k + 3]   # x's rows a stride apart
            across = torch.randn(k, m, generator=g).to(dtype).t()              # x's values a stride apart
            for x in (packed, apart, across):
                got = op(x, w)
                assert got.dtype == dtype and got.shape == (m, 300)
                want = F.linear(x.float(), w.float())
                tol = 1e-5 if dtype == torch.float32 else 1e-2
                torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * k ** 0.5)


def test_kernel_refuses_what_it_does_not_read(op):
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="at least one row of x, got 0"):
        op(torch.randn(0, 16), w)
    with pytest.raises(RuntimeError, match="one dtype"):
        op(torch.randn(1, 16, dtype=torch.bfloat16), w)
    with pytest.raises(RuntimeError, match="few_rows_linear: float32 or bfloat16, got Half"):
        op(torch.randn(1, 16).half(), w.half())
    with pytest.raises(RuntimeError, match="contiguous"):
        op(torch.randn(1, 8), w.t())


def test_kernel_runs_inside_a_compiled_graph(op):
    w, x = torch.randn(96, 64), torch.randn(1, 64)
    torch._dynamo.reset()
    try:
        out = torch.compile(lambda x, w: op(x, w).relu() + 1, dynamic=False)(x, w)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(out, F.linear(x, w).relu() + 1, rtol=1e-5, atol=1e-5)


def test_a_second_load_reuses_the_build(op, monkeypatch):
    first = library.kernel_report()
    assert first["path"].startswith(str(cache_dir()))
    monkeypatch.setattr(library, "_report", {})
    monkeypatch.setattr(library, "_build", lambda *a: pytest.fail("rebuilt an existing kernel"))
    assert library.few_rows_op() is not None
    again = library.kernel_report()
    assert again["path"] == first["path"] and again["build_s"] is None


def test_no_compiler_means_no_kernel_and_says_why(monkeypatch):
    monkeypatch.setattr(library, "_report", {})
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert library.few_rows_op() is None
    assert "no-such-compiler-here" in library.kernel_report()["reason"]
