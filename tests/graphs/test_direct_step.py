"""DirectStep: a whole compiled CPU step bound to its bucket's views replays its graph without dynamo,
on the live contents of those views and of the tensors it reads (weights, the KV cache), with the
same in-place writes; anything that is not one graph over the same inputs keeps dynamo's path."""
import functools

import torch

from phaseflip.graphs.compile import DirectStep, compile_whole_step

close = functools.partial(torch.allclose, rtol=1e-5, atol=1e-5)   # compiled sums round their own way


def _views():
    return {"x": torch.randn(4, 8), "slot": torch.tensor([1, 3])}


def _step(weight, cache):
    def step(views):
        h = views["x"] @ weight
        cache.index_copy_(0, views["slot"], h[:2])   # an in-place write, as the KV store's
        return torch.relu(h) + cache.sum()
    return step


def _no_dynamo(views):
    raise AssertionError("a bound step went through dynamo")


def test_a_bound_step_replays_live_buffers_and_writes_without_dynamo():
    torch._dynamo.reset()
    torch.manual_seed(0)
    weight, cache = torch.randn(8, 8), torch.zeros(5, 8)
    step = _step(weight, cache)
    direct, views = DirectStep(compile_whole_step(step)), _views()
    ref_cache = cache.clone()
    want = _step(weight, ref_cache)(views)
    assert close(direct(views), want) and close(cache, ref_cache)
    assert direct.direct is not None, "a one-graph step over the same inputs did not bind"
    direct.compiled = _no_dynamo
    for _ in range(2):   # new contents in the views, the weights and the cache, in place
        views["x"].copy_(torch.randn(4, 8))
        views["slot"].copy_(torch.tensor([0, 4]))
        weight.mul_(0.5)
        cache[2] += 1
        ref_cache.copy_(cache)
        want = _step(weight, ref_cache)(views)
        assert close(direct(views), want)
        assert close(cache, ref_cache), "the in-place write was not replayed"


def test_other_views_and_graph_breaks_keep_dynamos_path():
    torch._dynamo.reset()
    torch.manual_seed(1)
    weight, cache = torch.randn(8, 8), torch.zeros(5, 8)
    direct, views = DirectStep(compile_whole_step(_step(weight, cache))), _views()
    direct(views)
    calls = []
    compiled = direct.compiled
    direct.compiled = lambda v: calls.append(v) or compiled(v)
    other = dict(views)   # the same tensors in another dict: not the bound bucket's
    assert close(direct(other), _step(weight, cache.clone())(other))
    assert calls == [other]

    def broken(views):
        h = views["x"] @ weight
        torch._dynamo.graph_break()
        return h * 2
    split = DirectStep(compile_whole_step(broken))
    assert close(split(views), broken(views))
    assert split.direct is None, "a step of two graphs bound"
    assert close(split(views), broken(views))
