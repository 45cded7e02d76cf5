"""The Triton kernel cases run in ONE subprocess per session, started at the session's start
(tests/background.py): on CUDA when present, else on the CPU through Triton's interpreter.
TRITON_INTERPRET must be set before triton is first imported (triton's own @jit helpers are built
then), so it is set in that subprocess only: no other test sees it, and an earlier `import triton` in
this process cannot spoil it."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tests import background


@background.register("kernel_results")
def _kernel_selfcheck(session: background.Session) -> background.Job | None:
    """phaseflip/kernels/selfcheck.py's cases of the selected tests; TRITON_INTERPRET set in that process
    only, without CUDA. None without triton (the fixture says so)."""
    if importlib.util.find_spec("triton") is None:
        return None
    import torch
    names = sorted({item.callspec.params["name"] for item in session.items   # the cases this session runs
                    if item.originalname == "test_kernel_matches_reference" and item.get_closest_marker("skip") is None})
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    return background.python("-m", "phaseflip.kernels.selfcheck", *names, env=env)


@pytest.fixture(scope="session")
def kernel_results(_background_jobs) -> dict[str, dict]:
    """name -> {"ok", "max_abs_err" | "error"} for the cases selected in this session."""
    if "kernel_results" not in _background_jobs:
        pytest.skip("triton is not installed (pip install triton, or the gpu extra): the Triton kernel "
                    "tests need it, even on the CPU, where they run through its interpreter")
    done = _background_jobs["kernel_results"].result(timeout_s=600)
    try:
        results = json.loads(done.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"the kernel self-check crashed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return {r["name"]: r for r in results}
