"""SavedSteps (graphs/saved_steps.py): a step compiled by one owner is loaded by the next from its
directory, without tracing; shapes its guards do not cover compile a form of their own; a step that
cannot be saved runs traced, with the reason reported; within saved_only a shape no saved form serves
is refused, never compiled. SavedLayer: one decoder layer's graphs serve every
layer index, saved and loaded alike."""
from dataclasses import dataclass

import pytest
import torch
from torch._dynamo.utils import counters

from phaseflip.graphs import saved_steps
from phaseflip.graphs.saved_steps import SavedLayer, SavedSteps

pytestmark = pytest.mark.skipif(not saved_steps.available(),
                                reason="this torch cannot save compiled functions (torch.compiler.load_compiled_function)")


@dataclass(frozen=True)
class Owner:
    weight: torch.Tensor


def step(owner: Owner, views: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.relu(views["x"] @ owner.weight).sum(dim=-1) + views["bias"]


def broken(owner: Owner, views: dict[str, torch.Tensor]) -> torch.Tensor:
    y = views["x"] @ owner.weight
    torch._dynamo.graph_break()
    return y.sum(dim=-1) + views["bias"]


def _views(rows: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(rows, 8), "bias": torch.randn(rows)}


def test_a_second_owner_loads_what_the_first_compiled(tmp_path):
    owner = Owner(torch.randn(8, 4))
    first = SavedSteps(step, owner, tmp_path)
    v4, v8 = _views(4), _views(8)
    torch.testing.assert_close(first(v4), step(owner, v4))
    torch.testing.assert_close(first(v8), step(owner, v8))   # the dynamic form or one of its own
    assert first.report["compiled"]

    torch._dynamo.reset()
    counters.clear()
    second = SavedSteps(step, Owner(torch.randn(8, 4)), tmp_path)   # other weights, same shapes
    for v in (v4, v8):
        torch.testing.assert_close(second(v), step(second.owner, v))
    assert second.report["compiled"] == [] and second.report["loaded"]
    assert counters["stats"]["unique_graphs"] == 0

    wider = SavedSteps(step, Owner(torch.randn(8, 6)), tmp_path)   # a shape the saved guards refuse
    torch.testing.assert_close(wider(v4), step(wider.owner, v4))
    assert len(wider.report["compiled"]) == 1


def test_a_step_that_cannot_be_saved_runs_traced_and_says_why(tmp_path):
    owner, v = Owner(torch.randn(8, 4)), _views(4)
    saved = SavedSteps(broken, owner, tmp_path)
    torch.testing.assert_close(saved(v), broken(owner, v))
    assert "not_saved" in saved.report and saved.report["compiled"] == []
    assert not list(tmp_path.glob("*.pt"))


def test_saved_only_runs_what_a_saved_form_serves_and_compiles_nothing(tmp_path):
    """Within saved_only: rows the dynamic form's guards cover run (and bind); a shape no saved form
    serves raises Unserved, compiles nothing and binds nothing, so outside it compiles as before; a
    step that cannot be saved (traced: it might recompile) is Unserved at any new shape."""
    owner = Owner(torch.randn(8, 4))
    saved = SavedSteps(step, owner, tmp_path)
    saved(_views(32))
    files = sorted(tmp_path.glob("*.pt"))
    with saved.saved_only():
        for rows in (2, 7, 31):
            v = _views(rows)
            torch.testing.assert_close(saved(v), step(owner, v))
        with pytest.raises(saved_steps.Unserved, match="no saved form of step serves 1 rows"):
            saved(_views(1))   # 0/1 specialisation: the dynamic form does not serve one row
    assert sorted(tmp_path.glob("*.pt")) == files and len(saved.report["compiled"]) == 1
    v1 = _views(1)
    torch.testing.assert_close(saved(v1), step(owner, v1))
    assert len(saved.report["compiled"]) == 2

    traced = SavedSteps(broken, owner, tmp_path / "broken")
    traced(_views(4))
    with traced.saved_only(), pytest.raises(saved_steps.Unserved):
        traced(_views(5))


def toy_layer(lw, cfg, shard, delta, residual, meta, kv, layer, cos_sin, comm):
    """decoder_layer's signature: the residual stream updated, and a value read from this layer's slot."""
    h = residual if delta is None else residual + delta
    return torch.relu(h @ lw) + kv[layer] + cos_sin.sum(-1, keepdim=True) + meta["bias"], h


def _layers(layer_fn, lws, kv, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    residual, cos_sin = torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)
    meta, delta = {"bias": torch.randn(rows, 1, generator=g)}, None
    for i, lw in enumerate(lws):
        delta, residual = layer_fn(lw, None, None, delta, residual, meta, kv, i, cos_sin, None)
    return delta, residual


def test_one_layer_graph_serves_every_layer_index_saved_and_loaded(tmp_path):
    lws, kv = [torch.randn(8, 8) for _ in range(6)], torch.randn(6, 8)
    torch._dynamo.reset()   # a later layer compiled first, with no earlier trace of the frame to learn from
    alone = SavedLayer(toy_layer, tmp_path / "alone")
    delta, residual, cos_sin = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 4)
    meta = {"bias": torch.randn(4, 1)}
    for i in (1, 3):
        torch.testing.assert_close(alone(lws[i], None, None, delta, residual, meta, kv, i, cos_sin, None),
                                   toy_layer(lws[i], None, None, delta, residual, meta, kv, i, cos_sin, None))

    first = SavedLayer(toy_layer, tmp_path)
    for rows, seed in ((4, 0), (8, 1)):
        torch.testing.assert_close(_layers(first, lws, kv, rows, seed), _layers(toy_layer, lws, kv, rows, seed))
    assert len(first.report["compiled"]) == 1   # the first layer too (a zero delta): one graph

    torch._dynamo.reset()
    counters.clear()
    second = SavedLayer(toy_layer, tmp_path)
    for rows, seed in ((8, 2), (16, 3)):
        torch.testing.assert_close(_layers(second, lws, kv, rows, seed), _layers(toy_layer, lws, kv, rows, seed))
    assert second.report["compiled"] == [] and len(second.report["loaded"]) == 1
    assert counters["stats"]["unique_graphs"] == 0


def test_layers_whose_weights_differ_in_shape_are_bound_apart(tmp_path):
    """A GGUF file may store one layer's weight in another format (another shape) than the next: each
    kind of layer gets its own bound graph, never one specialised on another's weights."""
    lws = [torch.randn(8, 8), torch.randn(8, 8).t(), torch.randn(8, 12)[:, :8], torch.randn(8, 8)]
    kv = torch.randn(4, 8)
    saved = SavedLayer(toy_layer, tmp_path)
    torch.testing.assert_close(_layers(saved, lws, kv, 4, 0), _layers(toy_layer, lws, kv, 4, 0))
    assert len(saved._bound) == 3   # each of three storages once (the first layer's is the fourth's)
