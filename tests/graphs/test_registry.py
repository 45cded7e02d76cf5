"""GraphRegistry (bucket lookup, eager-fallback and capture counting) and capture_eager's recorded step."""
import pytest
import torch

from phaseflip.graphs.buffers import BufferSpec, StaticBuffers
from phaseflip.graphs.capture import CapturedStep, StepKey, capture_eager
from phaseflip.graphs.registry import GraphRegistry

I64 = torch.int64


def _step(layout: str, phase: str, bucket: int) -> CapturedStep:
    return CapturedStep(key=StepKey(layout, phase, bucket), backend="eager", views={},
                        runs={"step": lambda: torch.zeros(bucket)}, capture_ms=0.0)


def _registry(decode=(1, 2, 4, 8), prefill=(32, 64, 128), layout="single") -> GraphRegistry:
    reg = GraphRegistry()
    # inserted out of order on purpose: lookup must not depend on the capture order
    for b in reversed(decode):
        reg.add(_step(layout, "decode", b))
    for t in prefill:
        reg.add(_step(layout, "prefill", t))
    return reg


@pytest.mark.parametrize("size,bucket", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (7, 8), (8, 8)])
def test_lookup_picks_the_smallest_bucket_that_fits(size, bucket):
    reg = _registry()
    step = reg.lookup("single", "decode", size)
    assert step is not None and step.key == StepKey("single", "decode", bucket)
    assert not reg.eager_fallbacks, "a size that fits a bucket is not a fallback"


@pytest.mark.parametrize("size,bucket", [(1, 32), (32, 32), (33, 64), (40, 64), (100, 128), (128, 128)])
def test_lookup_prefill_buckets(size, bucket):
    assert _registry().lookup("single", "prefill", size).key.bucket == bucket


def test_above_the_largest_bucket_is_none_and_counted_per_layout_and_phase():
    reg = _registry()
    reg.add(_step("tp", "decode", 4))
    assert reg.lookup("single", "decode", 9) is None
    assert reg.lookup("single", "decode", 12) is None
    assert reg.lookup("single", "prefill", 300) is None
    assert reg.lookup("tp", "decode", 5) is None
    assert reg.lookup("tp", "decode", 4) is not None
    assert dict(reg.eager_fallbacks) == {("single", "decode"): 2, ("single", "prefill"): 1,
                                         ("tp", "decode"): 1}


def test_lookup_of_an_uncaptured_phase_is_a_counted_fallback():
    reg = _registry(prefill=())
    assert reg.lookup("single", "prefill", 1) is None
    assert reg.lookup("pp", "decode", 1) is None
    assert dict(reg.eager_fallbacks) == {("single", "prefill"): 1, ("pp", "decode"): 1}


def test_duplicate_capture_is_an_error():
    reg = _registry()
    with pytest.raises(ValueError, match="already captured"):
        reg.add(_step("single", "decode", 4))
    assert len(reg) == 7
    reg.add(_step("tp", "decode", 4))   # same bucket, other layout: a different step
    assert len(reg) == 8


def test_captures_before_and_after_seal_are_counted_apart():
    reg = _registry()
    assert (reg.captures_at_boot, reg.captures_after_boot) == (7, 0)
    reg.seal()
    reg.add(_step("single", "decode", 16))
    assert (reg.captures_at_boot, reg.captures_after_boot) == (7, 1)
    assert reg.lookup("single", "decode", 12).key.bucket == 16, "a late capture is still looked up"
    assert len(reg) == len(reg.steps()) == 8


def _buffers() -> StaticBuffers:
    return StaticBuffers({"x": BufferSpec((8,), I64, 0), "seq": BufferSpec((4,), I64, -1)})


def test_capture_eager_replays_against_the_same_views_every_time():
    buffers = _buffers()
    seen = []

    def fn(views):
        seen.append({k: (v.data_ptr(), tuple(v.shape)) for k, v in views.items()})
        return views["x"].clone()

    step = capture_eager(StepKey("single", "decode", 4), fn, buffers, {"x": 4, "seq": 2})
    assert seen == [], "capture without warm-up must not run the step"
    assert step.backend == "eager" and step.buffer_shapes() == {"x": (4,), "seq": (2,)}
    outs = []
    for n in (3, 1, 4, 0):
        buffers.fill("x", torch.arange(n, dtype=I64) + 1, 4)
        outs.append(step.replay().tolist())
    assert outs == [[1, 2, 3, 0], [1, 0, 0, 0], [1, 2, 3, 4], [0, 0, 0, 0]], \
        "replay must read what was filled into the static buffers"
    assert step.replays == 4
    ptrs = {"x": buffers.tensors["x"].data_ptr(), "seq": buffers.tensors["seq"].data_ptr()}
    assert all({k: p for k, (p, _) in s.items()} == ptrs for s in seen)
    assert all(s == seen[0] for s in seen), "every replay sees the same views"
    assert all(v.data_ptr() == ptrs[k] for k, v in step.views.items())


def test_capture_eager_warmup_runs_the_step_once():
    calls = []
    step = capture_eager(StepKey("single", "prefill", 8), lambda v: calls.append(1) or v["x"],
                         _buffers(), {"x": 8, "seq": 4}, warmup=True)
    assert calls == [1] and step.replays == 0 and step.capture_ms >= 0


def test_an_eager_step_replays_exact_size_inputs_and_a_compiled_one_refuses_them():
    """On the CPU an eager step runs at the batch's exact size (padding rows are wasted arithmetic);
    a compiled step is bound to its bucket's shapes and must say so rather than run on other shapes."""
    fn = lambda v: v["x"] * 2  # noqa: E731
    eager = capture_eager(StepKey("single", "decode", 4), fn, _buffers(), {"x": 4, "seq": 2})
    assert eager.exact_size
    assert eager.replay({"x": torch.tensor([1, 2, 3])}).tolist() == [2, 4, 6] and eager.replays == 1
    compiled = capture_eager(StepKey("single", "decode", 4), fn, _buffers(), {"x": 4, "seq": 2},
                             backend="compiled")
    assert not compiled.exact_size
    with pytest.raises(ValueError, match="compiled step replays its bucket's views only"):
        compiled.replay({"x": torch.tensor([1, 2, 3])})
