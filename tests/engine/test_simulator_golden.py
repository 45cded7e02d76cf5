"""The policy simulator's decision records, byte for byte against a checked-in golden file.

Five fixed scenarios on a fixed rig (every cost is a number written here, nothing is measured): the
throughput policy on a batch that fills the KV pool (the drain cycle), on arrival waves, and with its
first two flips failing (the fallback); the latency policy with a TTFT budget on the same waves; the
drain rule (policy="drain") on the same waves. Each line of simulator_golden.jsonl is
json.dumps([scenario, kind, record], sort_keys=True): kind "decision" is Decision.record(inputs) of every
decision taken, "flip" every flip attempt the simulator logged, "result" the run's totals.

A change to the policy's behaviour shows up here as a changed line. When the change is meant, regenerate:

    PHASEFLIP_REGEN_GOLDEN=1 .venv/bin/python -m pytest -q -p no:cacheprovider tests/engine/test_simulator_golden.py

which rewrites the file and fails saying so (run it again to see it pass); review the diff, commit it.
"""
import json
import os
from pathlib import Path

import pytest

from phaseflip.engine.policy.decide import decide
from phaseflip.engine.policy.terms import Decision, PolicyConfig
from phaseflip.engine.policy.rules import DrainRule
from phaseflip.engine.simulator import rig as sim_rig, run as sim
from phaseflip.engine.simulator.trace import TraceRequest

GOLDEN = Path(__file__).with_name("simulator_golden.jsonl")
REGEN = "PHASEFLIP_REGEN_GOLDEN"


def q(value):
    return {"value": value, "basis": "assumption: golden test rig"}


RIG = sim_rig.rig_from_dict({
    "name": "golden-rig",
    "engine": {"max_num_seqs": q(16), "chunk_tokens": q(512), "block_size": q(16), "num_kv_blocks": q(256),
               "idle_poll_s": q(0.001)},
    "layouts": {"pp": {"prefill_tok_s": q(8000), "decode_step_s": q({"1": 0.040, "16": 0.050}),
                       "mixed_step_shared": q(0.25)},
                "tp": {"prefill_tok_s": q(2000), "decode_step_s": q({"1": 0.010, "16": 0.014}),
                       "mixed_step_shared": q(0.5)}},
    "flips": {"pp->tp": {"samples_s": q([0.3, 0.5]), "prior_s": q(0.4)},
              "tp->pp": {"samples_s": q([0.4, 0.2]), "prior_s": q(0.3)},
              "failed_flip_fraction": q(0.5)}})


def waves():
    """16 requests in two waves of 8 (50 ms apart within a wave, 2 s between waves), mixed lengths."""
    return [TraceRequest(round(0.05 * (i % 8) + 2.0 * (i // 8), 3), 512 + 37 * (i % 5), 24 + 4 * (i % 3), 56)
            for i in range(16)]


def drain_rule_decide():
    """policy="drain" (rules.DrainRule) as a decide_fn: its stay while the open phase has work, else the
    flip its on_idle asks for (the engine flips when a step with the open phases could run nothing)."""
    rule = DrainRule(("pp", "tp"))

    def decide_fn(w, config):
        d = rule.decide(w.active)
        if (d.prefill and w.admissible_prefill_tokens) or (d.decode and w.num_carried_decodes):
            return d
        target = rule.on_idle(w.active)
        return Decision("flip", target, "drain: on_idle flip", target == "pp", target != "pp")
    return decide_fn


def scenarios():
    return {
        "throughput-batch": dict(trace=[TraceRequest(0.0, 512, 24, 48)] * 24, config=PolicyConfig()),
        "throughput-waves": dict(trace=waves(), config=PolicyConfig()),
        "throughput-failed-flips": dict(trace=[TraceRequest(0.0, 256, 24, 48)] * 20, config=PolicyConfig(),
                                        flip_faults={0, 1}),
        "latency-waves": dict(trace=waves(), config=PolicyConfig(mode="latency", ttft_budget_s=0.5)),
        "drain-waves": dict(trace=waves(), config=PolicyConfig(), decide_fn=drain_rule_decide()),
    }


def record_lines() -> list[str]:
    lines = []
    for name, kw in scenarios().items():
        inner, decisions = kw.pop("decide_fn", decide), []

        def recording(w, config, inner=inner, decisions=decisions):
            d = inner(w, config)
            decisions.append(d.record(w))
            return d
        r = sim.simulate(RIG, kw.pop("trace"), kw.pop("config"), decide_fn=recording, **kw)
        result = {"completed": r.completed, "makespan_s": r.makespan_s, "flips": r.flips,
                  "failed_flips": r.failed_flips, "flip_time_s": r.flip_time_s,
                  "idle_polls_with_work": r.idle_polls_with_work, "ttft_s": list(r.ttft_s),
                  "num_decisions": len(decisions)}
        records = ([("decision", d) for d in decisions] + [("flip", e) for e in r.events]
                   + [("result", result)])
        lines += [json.dumps([name, kind, rec], sort_keys=True) for kind, rec in records]
    return lines


def test_simulator_decision_records_match_the_golden_file():
    """Every decision (time, layout, action, target, reason, open phases and the numbers its rule compared),
    every flip attempt and each run's totals are what they were when the golden file was written."""
    text = "\n".join(record_lines()) + "\n"
    if os.environ.get(REGEN) == "1":
        GOLDEN.write_text(text, encoding="utf-8")
        pytest.fail(f"{REGEN}=1: rewrote {GOLDEN.name}; review its diff, then run again without {REGEN}")
    golden = GOLDEN.read_text(encoding="utf-8")
    if text == golden:
        return
    new, old = text.splitlines(), golden.splitlines()
    i = next((i for i, (a, b) in enumerate(zip(new, old)) if a != b), min(len(new), len(old)))
    pytest.fail(f"decision records differ from {GOLDEN.name} at line {i + 1} ({len(new)} lines now, "
                f"{len(old)} in the file):\n  golden: {old[i] if i < len(old) else '<end>'}\n"
                f"  now:    {new[i] if i < len(new) else '<end>'}\n"
                f"If the change is meant, regenerate with {REGEN}=1 (see this module's docstring).")


def test_the_scenarios_flip_both_ways_under_every_policy():
    """The golden file pins decisions worth pinning: each scenario flips out and back (or fails to)."""
    flips = {}
    for line in GOLDEN.read_text(encoding="utf-8").splitlines():
        name, kind, rec = json.loads(line)
        if kind == "flip":
            flips.setdefault(name, []).append((rec["direction"], rec["ok"]))
    assert set(flips) == set(scenarios())
    for name, attempts in flips.items():
        directions = {d for d, ok in attempts if ok}
        assert directions == {"pp->tp", "tp->pp"} or not all(ok for _, ok in attempts), (name, attempts)
