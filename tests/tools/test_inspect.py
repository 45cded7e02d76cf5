"""The boot manifest and `phaseflip inspect` on two CPU ranks with both layouts."""
import json
import xml.dom.minidom

import pytest
from click.testing import CliRunner

from phaseflip import LLM, SamplingParams
from phaseflip.tools.cli import main
from phaseflip.tools.inspect_cmd import LEDGER_TERMS, render_text


@pytest.fixture(scope="module")
def manifest(tiny_model_dir, tmp_path_factory):
    d = tiny_model_dir("llama")
    with LLM(model=str(d), dtype="float32", world_size=2, park="always", flip_every_steps=1,
             max_num_seqs=8, rank_memory_gib=(1.5, 1.0)) as llm:
        llm.generate(["the quick brown fox"] * 3, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                     use_tqdm=False)
        m = llm.inspect()
        stats = llm.stats()
    path = tmp_path_factory.mktemp("manifest") / "m.json"
    path.write_text(json.dumps(m))
    return m, stats, path


def test_manifest_lists_steps_of_both_layouts_on_every_rank(manifest):
    m, stats, _ = manifest
    for rank in (0, 1):
        for layout in ("pp", "tp"):
            for phase in ("prefill", "decode"):
                steps = [s for s in m["steps"] if (s["rank"], s["layout"], s["phase"]) == (rank, layout, phase)]
                assert steps, (rank, layout, phase)
                assert all(s["capture_ms"] is not None and s["buffers"]["input_ids"] for s in steps)
    assert m["captures_at_boot"] == stats["captures_at_boot"] == len(m["steps"])
    assert stats["flips"] >= 20 and stats["captures_after_boot"] == 0
    assert len(m["flips"]) == len(stats["flip_log"])


def test_every_ledger_sums_to_its_budget_exactly(manifest):
    m, _, _ = manifest
    budgets = {0: int(1.5 * 2**30), 1: int(1.0 * 2**30)}
    for r in m["ranks"]:
        for layout, ledger in r["ledger"].items():
            assert ledger["budget"] == budgets[r["rank"]]
            assert ledger["unmeasured"] == []
            assert sum(ledger[t] for t in LEDGER_TERMS) == ledger["budget"], (r["rank"], layout)
            assert ledger["sums_to_budget"] is True
            assert ledger["arena"] == max(r_ledger["arena_layout_bytes"] for r_ledger in r["ledger"].values())


def test_no_term_is_negative_and_the_measured_use_is_explained(manifest):
    """Every term measured on its own, none negative; what the terms do not account for of
    the measured RSS is `unexplained`, small when every reading is right (0.5-0.9% on SmolLM2)."""
    m, _, _ = manifest
    for r in m["ranks"]:
        for layout, ledger in r["ledger"].items():
            assert all(ledger[t] >= 0 for t in LEDGER_TERMS if t not in ("unexplained", "free")), ledger
            assert ledger["host_images"] > 0  # park="always": the parked image is held on the host
            assert abs(ledger["unexplained"]) < 0.05 * ledger["measured_used"], (r["rank"], layout, ledger)


def test_a_wrong_graph_pool_reading_shows_as_unexplained(tiny_model_dir):
    """Break one reading on purpose: the identity no longer closes, and the ledger says by how much
    instead of folding the error into another term."""
    with LLM(model=str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=4, max_model_len=64) as llm:
        runtime = llm.ranks.runtime
        # RSS can shrink while the GEMMs warm (the ledger shows a shrink as none): break it from what it shows
        runtime.gemm_bytes = max(runtime.gemm_bytes, 0)
        right = llm.inspect()["ranks"][0]["ledger"]["pp"]
        runtime.gemm_bytes += 64 * 2**20
        wrong = llm.inspect()["ranks"][0]["ledger"]["pp"]
    assert wrong["graph_pool"] == right["graph_pool"] + 64 * 2**20
    assert wrong["unexplained"] == right["unexplained"] - 64 * 2**20 != 0
    assert wrong["framework_overhead"] == right["framework_overhead"] and wrong["sums_to_budget"] is True


def test_unusable_kv_is_shown_not_hidden(manifest):
    """3 layers and 2 KV heads over 2 ranks cannot match fractions: some KV bytes are unusable."""
    m, _, _ = manifest
    assert m["plan"]["balanced"] is False and m["plan"]["notes"]
    assert any(r["ledger"][lay]["kv_unusable"] > 0 for r in m["ranks"] for lay in ("pp", "tp"))


def test_inspect_prints_tables_json_and_svg(manifest, tmp_path):
    _, _, path = manifest
    runner = CliRunner()
    text = runner.invoke(main, ["inspect", str(path)])
    assert text.exit_code == 0, text.output
    for heading in ("captured steps", "memory ledger", "boot timeline", "flips (", "prefix cache: prompt tokens computed"):
        assert heading in text.output
    m = json.loads(path.read_text())
    m["ranks"][0]["compile"].setdefault("pp", {})["fused_layers"] = {"choice": "fused layers", "reason": None,
                                                                     "rows": 8}
    shown = render_text(m)
    assert "pp fused_layers: fused layers" in shown and "— None" not in shown   # no reason: none shown
    as_json = runner.invoke(main, ["inspect", str(path), "--json"])
    assert json.loads(as_json.output)["phaseflip_manifest"] == 1
    pc = json.loads(as_json.output)["prefix_cache"]
    assert pc["enabled"] and pc["prompt_tokens_computed"] + pc["prompt_tokens_reused"] >= 3 * 4
    svg = tmp_path / "m.svg"
    drawn = runner.invoke(main, ["inspect", str(path), "--svg", str(svg)])
    assert drawn.exit_code == 0
    doc = xml.dom.minidom.parse(str(svg))
    assert doc.documentElement.tagName == "svg"
    assert len(doc.getElementsByTagName("rect")) > 20


def test_inspect_boots_a_model_without_generating(tiny_model_dir):
    result = CliRunner().invoke(main, ["inspect", "--model", str(tiny_model_dir("llama")), "--world-size", "2",
                                       "--layouts", "pp,tp", "--json"])
    assert result.exit_code == 0, result.output
    m = json.loads(result.output)
    assert {s["layout"] for s in m["steps"]} == {"pp", "tp"} and m["flips"] == []


def test_dot_draws_the_layouts_their_steps_and_the_flips(manifest, tmp_path):
    m, _, path = manifest
    out = tmp_path / "m.dot"
    result = CliRunner().invoke(main, ["inspect", str(path), "--dot", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert text.startswith("digraph phaseflip {") and text.rstrip().endswith("}")
    assert text.count("{") == text.count("}") and text.count('"') % 2 == 0
    steps = {f'"{s["layout"]}:{s["phase"]}:{s["bucket"]}"' for s in m["steps"] if s["rank"] == 0}
    declared = {line.split(" [")[0].strip() for line in text.splitlines() if "shape=ellipse" in line}
    assert declared == steps and {'"layout pp"', '"layout tp"'} <= {
        line.split(" [")[0].strip() for line in text.splitlines() if "shape=box" in line}
    flips = [line for line in text.splitlines() if "style=bold" in line]
    for direction in ("pp->tp", "tp->pp"):
        n = sum(1 for e in m["flips"] if e["direction"] == direction)
        (edge,) = [line for line in flips if f"{direction}: " in line]
        source, target = direction.split("->")
        assert edge.strip().startswith(f'"layout {source}" -> "layout {target}"') and f"{n} flip(s)" in edge


def test_missing_manifest_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "nope.json")])
    assert result.exit_code != 0 and "no manifest" in result.output


@pytest.mark.parametrize("text", ['{"not": closed', '{"a": 1}\n{"b": 2}\n', "[1, 2]"])
def test_a_file_that_is_not_a_manifest_is_named(tmp_path, text):
    from click.testing import CliRunner
    from phaseflip.tools.cli import main
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    result = CliRunner().invoke(main, ["inspect", str(bad)])
    assert result.exit_code == 2 and f"{bad} is not a boot manifest" in result.output, result.output
