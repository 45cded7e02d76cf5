"""Mixture-of-experts kernels: routing as transformers computes it, the reference's expert sum against a
naive float64 loop written from the formula, and the CPU's grouped products against the reference (fp32
and bf16, 1-300 tokens, top-1 to top-4, experts nobody chose)."""
import pytest
import torch
import torch.nn.functional as F

from phaseflip.kernels import dispatch
from phaseflip.kernels.reference import moe

F64 = torch.float64


def random_experts(tokens: int, experts: int, top_k: int, dtype, seed: int = 0, hidden: int = 48, inter: int = 40):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(dtype)
    # skewed logits so that some experts go unchosen
    logits = torch.randn(tokens, experts, generator=g) + torch.linspace(0, 3, experts)
    weights, ids = moe.route(logits, top_k, normalize=True)
    return h, gate_up, down, ids, weights


def naive(h, gate_up, down, ids, weights):
    """Token by token, chosen expert by chosen expert, in float64."""
    out = torch.zeros(h.shape, dtype=F64)
    inter = gate_up.shape[1] // 2
    for t in range(h.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            gu = gate_up[e].to(F64) @ h[t].to(F64)
            act = gu[:inter] / (1 + torch.exp(-gu[:inter])) * gu[inter:]
            out[t] += w * (down[e].to(F64) @ act)
    return out


def test_route_is_softmax_then_top_k_then_renormalised():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.5, 4.0, 1.0]])
    probs = torch.softmax(logits, -1)
    weights, ids = moe.route(logits, 2, normalize=False)
    assert ids.tolist() == [[1, 2], [2, 3]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    normed, _ = moe.route(logits, 2, normalize=True)
    torch.testing.assert_close(normed, weights / weights.sum(-1, keepdim=True))
    assert normed.dtype == torch.float32


@pytest.mark.parametrize("tokens,top_k", [(1, 2), (5, 1), (17, 4), (300, 2)])
def test_reference_matches_the_naive_loop(tokens, top_k):
    args = random_experts(tokens, 6, top_k, torch.float32, seed=tokens)
    torch.testing.assert_close(moe.experts(*args).to(F64), naive(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 2), (3, 8, 2), (4, 8, 4), (33, 6, 1), (300, 8, 2)])
def test_cpu_grouped_experts_match_the_reference(dtype, tokens, experts, top_k):
    args = random_experts(tokens, experts, top_k, dtype, seed=tokens + experts)
    ours = dispatch.moe_experts(*args)
    assert ours.shape == args[0].shape and ours.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ours.float(), moe.experts(*args).float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2, 4])
def test_few_tokens_in_one_region_match_the_grouped_products(dtype, tokens):
    """moe.cpp's call (decode steps) against the expert-by-expert path on the same inputs, an expert chosen
    by several tokens among them."""
    from phaseflip.kernels.cpu import library
    from phaseflip.kernels.cpu import moe as cpu_moe
    if library.moe_rows_op() is None:
        pytest.skip(f"the CPU kernels are not built here: {library.kernel_report()['reason']}")
    h, gate_up, down, _, _ = random_experts(tokens, 5, 2, dtype, seed=7)
    ids = torch.tensor([[3, 1], [1, 4], [0, 3], [3, 2]])[:tokens]
    weights = torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.9, 0.1], [0.2, 0.8]])[:tokens]
    got = library.moe_rows_op()(h, gate_up, down, ids, weights)
    want = cpu_moe.grouped(h, gate_up, down, ids, weights)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    torch.testing.assert_close(got.float(), naive(h, gate_up, down, ids, weights).float(), **(
        tol if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)))


def test_cpu_grouped_experts_compile_as_one_opaque_call():
    args = random_experts(7, 4, 2, torch.float32)
    compiled = torch.compile(lambda *a: dispatch.moe_experts(*a) * 2, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(*args), moe.experts(*args) * 2, rtol=1e-5, atol=1e-5)


def test_reference_is_linear_in_the_weights():
    """A weight of 0 on an expert leaves it out: the sum over chosen experts, nothing else."""
    h, gate_up, down, ids, weights = random_experts(4, 4, 2, torch.float32)
    only_first = weights * torch.tensor([1.0, 0.0])
    one = moe.experts(h, gate_up, down, ids[:, :1], weights[:, :1])
    torch.testing.assert_close(moe.experts(h, gate_up, down, ids, only_first), one)
    y = F.silu(h @ gate_up[ids[0, 0]][:40].t()) * (h @ gate_up[ids[0, 0]][40:].t())
    torch.testing.assert_close(one[0], weights[0, 0] * (y[0] @ down[ids[0, 0]].t()), rtol=1e-5, atol=1e-5)
