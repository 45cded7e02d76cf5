"""The GPU check is wired: its dry run (the same steps on the CPU with tiny shapes) writes every section,
and a failing or late section is recorded without stopping the others."""
import argparse
import json
import os
import time

import pytest

from phaseflip.tools import gpu_check, gpu_sections_compile
from phaseflip.tools.gpu_context import DRY, GRACE_S, Context
from phaseflip.tools.gpu_sections_engine import engine_kwargs
from tests import background

SECTIONS = ("environment", "kernels", "bandwidth", "capture", "replay_vs_eager", "park_restore", "restore",
            "decode_throughput", "decode_step", "fp32_parity", "hf_decode", "quantized_decode", "decode_8b",
            "compile_boot", "kv_sizing")


@background.register("gpu_check_dry_run")
def _dry_run(session: background.Session) -> background.Job:
    """Its time budget (300 s in a dry run) is wall time: beside the suite the job may be starved for
    minutes by the suite's own threads, so it gets 900."""
    out_dir = session.mktemp("gpu-check-dry-run")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)   # the script sets it itself in a dry run
    return background.python("-m", "phaseflip.tools.gpu_check", "--dry-run", "--budget-s", "900",
                             "--out", str(out_dir), env=env, out_dir=out_dir)


@pytest.fixture(scope="session")
def gpu_check_dry_run(_background_jobs):
    """`python -m phaseflip.tools.gpu_check --dry-run`, run beside the suite (tests/background.py)."""
    return _background_jobs["gpu_check_dry_run"]


def test_dry_run_writes_every_section(gpu_check_dry_run):
    proc, tmp_path = gpu_check_dry_run.result(timeout_s=180), gpu_check_dry_run.out_dir
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    s = report["sections"]
    assert tuple(s) == SECTIONS == tuple(f.__name__ for f in gpu_check.SECTIONS)
    failed = {name: sec.get("error") for name, sec in s.items() if not sec.get("ok")}
    assert proc.returncode == 0 and not failed, (failed, proc.stderr[-3000:])
    assert report["dry_run"] and "section hf_decode" in (tmp_path / "gpu_check.log").read_text()
    assert s["kernels"]["num_passed"] == s["kernels"]["num_cases"] >= 7 and s["kernels"]["graph_replay"]["ok"]
    assert s["bandwidth"]["device_gb_s"] > 0 and s["bandwidth"]["h2d_gb_s"] > 0
    for layout in ("pp", "tp"):
        assert s["capture"][layout]["num_steps"] > 0 and s["capture"][layout]["capture_ms"] is not None
    assert s["replay_vs_eager"]["num_identical"] == s["replay_vs_eager"]["num_prompts"]
    assert s["replay_vs_eager"]["seeded_sampling"]["num_identical"] == s["replay_vs_eager"]["num_prompts"]
    assert s["decode_step"]["sampled"]["wall_ms_per_step"] > 0
    pr = s["park_restore"]
    assert pr["cycles"] == 10 and pr["all_identical"] and pr["arena_ptrs_stable"]
    assert s["restore"]["ratio_to_floor"] > 0
    assert [r["batch"] for r in s["decode_throughput"]["rows"]] == [1, 8, 64]
    assert all(r["tokens_per_s"] > 0 and r["bandwidth_bound_tokens_per_s"] > 0 for r in s["decode_throughput"]["rows"])
    assert [r["batch"] for r in s["hf_decode"]["rows"]] == [1, 8, 64]
    assert s["fp32_parity"]["ok"]
    q = s["quantized_decode"]["rows"]
    assert [r["make_up"] for r in q] == ["Q8_0", "Q4_K_M"] and all(r["fraction_of_bound"] > 0 for r in q)
    assert set(q[1]["bytes_by_storage"]) == {"Q4_K", "Q6_K", "bfloat16"} and q[1]["against_bf16_batch_1"] > 0
    assert s["decode_8b"]["tokens_per_s_batch_1"] > 0 and s["decode_8b"]["fraction_of_bound"] > 0
    for name in ("llama-1b", "smollm2-30"):   # each boot a process of its own
        m = s["compile_boot"]["models"][name]
        assert m["cold"]["finished"] and m["warm"]["finished"] and m["uncompiled"]["finished"], m
        assert set(m["speedup"]) == {"1", "8", "64"} and m["targets_met"] is None   # dry run: compile="off"
    kv = s["kv_sizing"]   # the CPU keeps kv_cache_memory_gib: the utilization figures are None, with the reason
    assert kv["kv_tokens"] > 0 and kv["used_fraction"] is None and "CPU" in kv["utilization_reason"]
    assert kv["negative_terms"] == [] and kv["tokens_match_shared_engine"] and kv["targets_met"] is None


def test_sections_runs_only_those_named(tmp_path):
    report = gpu_check.run(tmp_path, dry_run=True, budget_s=60, sections=("environment",))
    assert list(report["sections"]) == ["environment"] and report["ok"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown section 'bogus': allowed are environment"):
        gpu_check._section_names("environment,bogus")


def test_a_boot_that_fails_is_unfinished_with_its_reason(tmp_path):
    ctx = Context(DRY, True, tmp_path, time.monotonic() + 60, "off")
    spec = {"engine": engine_kwargs(DRY, tmp_path / "no-such-model"), "batches": [1], "prompt_len": 4, "new_tokens": 3}
    run = gpu_sections_compile._boot(ctx, spec, tmp_path / "cache")
    assert not run["finished"] and "exited 1" in run["reason"] and "no-such-model" in run["stderr_tail"]
    ctx.deadline = time.monotonic() - GRACE_S - 1
    assert gpu_sections_compile._boot(ctx, spec, tmp_path / "cache") == {"finished": False,
                                                                         "reason": "time budget spent"}


def test_a_failing_section_is_recorded_and_a_late_one_skipped(tmp_path, monkeypatch):
    def first(ctx):
        ctx.shared["x"] = 1
        return {"ok": True}

    def broken(ctx):
        raise ValueError("boom")

    def needs_missing(ctx):
        return {"ok": True, "y": ctx.need("y", "broken")}

    def spend_budget(ctx):
        ctx.deadline = 0.0
        return {"ok": True}

    def late(ctx):
        raise AssertionError("must not run after the budget")
    monkeypatch.setattr(gpu_check, "SECTIONS", (first, broken, needs_missing, spend_budget, late))
    report = gpu_check.run(tmp_path, dry_run=True, budget_s=60)
    s = report["sections"]
    assert s["first"]["ok"] and s["spend_budget"]["ok"]
    assert s["broken"]["ok"] is False and s["broken"]["error"] == "ValueError: boom"
    assert "needs 'y' from section 'broken'" in s["needs_missing"]["error"]
    assert s["late"] == {"ok": None, "skipped": "time budget spent"}
    assert report["ok"] is False
    assert json.loads((tmp_path / "gpu_check.json").read_text())["sections"].keys() == s.keys()
