"""SavedSteps (graphs/saved_steps.py): a step compiled by one owner is loaded by the next from its
directory, without tracing; shapes its guards do not cover compile a form of their own; a step that
cannot be saved runs traced, with the reason reported."""
from dataclasses import dataclass

import pytest
import torch
from torch._dynamo.utils import counters

from phaseflip.graphs import saved_steps
from phaseflip.graphs.saved_steps import SavedSteps

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
