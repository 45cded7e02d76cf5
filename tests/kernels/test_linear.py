"""kernels/linear.py: the weight-stationary product equals F.linear on every row count around its
threshold, with and without a bias, and returns an ordinary contiguous [M, N] tensor."""
import pytest
import torch
import torch.nn.functional as F

from phaseflip.kernels import linear as lin


@pytest.mark.parametrize("m", [1, 2, 3, lin.SMALL_BATCH, lin.SMALL_BATCH + 1, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(m, with_bias):
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 64, generator=g), torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if with_bias else None
    out = lin.linear(x, w, b)
    assert out.shape == (m, 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_no_rows_gives_no_rows():
    assert lin.linear(torch.empty(0, 8), torch.randn(4, 8)).shape == (0, 4)
