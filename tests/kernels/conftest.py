"""The Triton kernel cases run in ONE subprocess per session: on CUDA when present, else on the CPU
through Triton's interpreter. TRITON_INTERPRET must be set before triton is first imported (triton's
own @jit helpers are built then), so it is set in that subprocess only: no other test sees it, and an
earlier `import triton` in this process cannot spoil it."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

CASE_TEST = "test_kernel_matches_reference"


@pytest.fixture(scope="session")
def kernel_results(request) -> dict[str, dict]:
    """name -> {"ok", "max_abs_err" | "error"} for the cases selected in this session."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton, or the gpu extra): the Triton kernel "
                    "tests need it, even on the CPU, where they run through its interpreter")
    names = sorted({item.callspec.params["name"] for item in request.session.items
                    if item.originalname == CASE_TEST})
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-m", "phaseflip.kernels.selfcheck", *names], env=env,
                          capture_output=True, text=True, timeout=600)
    try:
        results = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"the kernel self-check crashed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return {r["name"]: r for r in results}
