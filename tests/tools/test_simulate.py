"""`phaseflip simulate` (tools/simulate.py), in-process through click's CliRunner on the command object:
the table for each shipped rig, --json, and clear errors for bad inputs."""
import json

import pytest
from click.testing import CliRunner

from phaseflip.engine.simulator import rig as sim_rig
from phaseflip.tools import simulate as simulate_module
from phaseflip.tools.simulate import simulate
from tests import shipped_rigs

ROWS = ("static pp", "static tp", "policy throughput", "policy latency")


def _invoke(*args):
    return CliRunner().invoke(simulate, [str(a) for a in args], catch_exceptions=False)


def _small_trace(tmp_path, n=24):
    path = tmp_path / "small.jsonl"
    lines = [json.dumps({"arrival_s": i * 0.5, "prompt_tokens": 200 + 50 * (i % 5),
                         "output_tokens": 20 + 10 * (i % 3)}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_help_documents_the_options():
    out = _invoke("--help")
    assert "--rig" in out.output and "--trace" in out.output and "--ttft-budget-s" in out.output


@pytest.mark.parametrize("rig", ["hetero-3card", "pcie4-4card"])
def test_prints_the_table_for_a_shipped_rig(rig, monkeypatch):
    """The shipped rig and trace by name; their rows are the session's (tests/shipped_rigs.py)."""
    def computed_once(rig_arg, trace, ttft_budget_s):
        assert (rig_arg.name, len(trace)) == (rig, 400)
        return shipped_rigs.rows(rig, ttft_budget_s)[1]
    monkeypatch.setattr(simulate_module, "compare", computed_once)
    result = _invoke("--rig", rig, "--trace", "mixed-trace.jsonl")
    assert result.exit_code == 0, result.output
    print("\n" + result.output)
    assert f"rig {rig}: 400 requests" in result.output
    for label in ROWS:
        assert label in result.output
    assert "TTFT p95" in result.output and "x best" in result.output


def test_accepts_files_by_path_and_prints_json(tmp_path):
    rig_path = sim_rig.RIGS_DIR / "pcie4-4card.json"
    result = _invoke("--rig", rig_path, "--trace", _small_trace(tmp_path), "--ttft-budget-s", 5, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["rig"] == "pcie4-4card" and data["ttft_budget_s"] == 5
    assert [r["label"] for r in data["rows"]][:3] == list(ROWS[:3])
    assert all(r["offline"]["completed"] and r["online"]["completed"] for r in data["rows"])
    assert data["rows"][0]["offline"]["flips"] == 0


def test_bad_rig_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(simulate, ["--rig", "nope", "--trace", str(_small_trace(tmp_path))])
    assert result.exit_code != 0 and "no rig profile 'nope'" in result.output
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x", "engine": {"chunk_tokens": 512}}')
    result = CliRunner().invoke(simulate, ["--rig", str(bad), "--trace", str(_small_trace(tmp_path))])
    assert result.exit_code != 0 and "rig.engine.chunk_tokens" in result.output


def test_bad_trace_and_budget_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    result = CliRunner().invoke(simulate, ["--rig", "pcie4-4card", "--trace", str(bad)])
    assert result.exit_code != 0 and "line 1" in result.output
    result = CliRunner().invoke(simulate, ["--rig", "pcie4-4card", "--trace", str(_small_trace(tmp_path)),
                                           "--ttft-budget-s", "0"])
    assert result.exit_code != 0 and "--ttft-budget-s" in result.output
