"""`phaseflip simulate`: the layout policy against a modelled rig and an arrival trace, beside the static
layouts, as one table.

Owns: the comparison (which runs, in which regimes) and its printing. The model and the runs are
engine/simulator/run.py's; the rules are engine/policy/decide.py's. Shipped inputs live in tools/rigs/: rig profiles
(hetero-3card.json, pcie4-4card.json: every number labelled measured / derived / assumption) and a mixed
arrival trace (mixed-trace.jsonl: 400 requests, Poisson arrivals at 2/s, seed 5; 50% chat: prompt 64-512,
output 32-384, max_tokens 512; 30% long documents: prompt 1500-6000, output 64-256, max_tokens 256; 20% long
generations: prompt 64-256, output 512-1536, max_tokens 2048; all uniform).

Two regimes per row: offline (every request submitted at t=0: a batch, where throughput is the
engine's capacity) and online (the trace's arrival times, where time to first token is meaningful).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import click

from phaseflip.engine.policy.terms import PolicyConfig
from phaseflip.engine.simulator import run as sim
from phaseflip.engine.simulator.rig import Rig, load_rig
from phaseflip.engine.simulator.trace import load_trace


@dataclass(frozen=True)
class Row:
    label: str
    offline: sim.SimResult
    online: sim.SimResult


def runs(ttft_budget_s: float) -> list[tuple[str, dict]]:
    """(label, simulate() keywords) of every row: the two static layouts, the policy in both modes."""
    return [
        ("static pp", dict(config=PolicyConfig(), decide_fn=sim.static_decide, start="pp")),
        ("static tp", dict(config=PolicyConfig(), decide_fn=sim.static_decide, start="tp")),
        ("policy throughput", dict(config=PolicyConfig())),
        (f"policy latency {ttft_budget_s:g} s",
         dict(config=PolicyConfig(mode="latency", ttft_budget_s=ttft_budget_s))),
    ]


def compare(rig: Rig, trace, ttft_budget_s: float) -> list[Row]:
    rows = []
    for label, kwargs in runs(ttft_budget_s):
        config = kwargs.pop("config")
        rows.append(Row(label, sim.simulate(rig, trace, config, offline=True, label=label, **kwargs),
                        sim.simulate(rig, trace, config, offline=False, label=label, **kwargs)))
    return rows


def best_static_tok_s(rows: list[Row]) -> float:
    return max(r.offline.tok_s for r in rows if r.label.startswith("static"))


def format_table(rig: Rig, rows: list[Row], ttft_budget_s: float) -> str:
    first = rows[0].offline
    best = best_static_tok_s(rows)
    lines = [f"rig {rig.name}: {first.num_requests} requests, {first.prompt_tokens:,} prompt + "
             f"{first.output_tokens:,} output tokens; TTFT budget {ttft_budget_s:g} s",
             f"{'':22s}| offline (all at t=0)                 | online (trace arrival times)",
             f"{'run':22s}| {'tok/s':>7s} {'x best':>7s} {'flips':>5s} {'flip s':>7s} {'done':>5s} "
             f"| {'tok/s':>7s} {'TTFT p50':>9s} {'TTFT p95':>9s} {'flips':>5s} {'done':>5s}"]
    for r in rows:
        off, on = r.offline, r.online
        lines.append(f"{r.label:22s}| {off.tok_s:7.0f} {off.tok_s / best:7.2f} {off.flips:5d} "
                     f"{off.flip_time_s:7.1f} {_done(off):>5s} | {on.tok_s:7.0f} {_s(on.ttft_pct(50)):>9s} "
                     f"{_s(on.ttft_pct(95)):>9s} {on.flips:5d} {_done(on):>5s}")
    return "\n".join(lines)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _done(r: sim.SimResult) -> str:
    return "yes" if r.completed else "NO"


def as_dict(rig: Rig, rows: list[Row], ttft_budget_s: float) -> dict:
    def one(r: sim.SimResult) -> dict:
        return {"tok_s": r.tok_s, "makespan_s": r.makespan_s, "flips": r.flips, "failed_flips": r.failed_flips,
                "flip_time_s": r.flip_time_s, "ttft_p50_s": r.ttft_pct(50), "ttft_p95_s": r.ttft_pct(95),
                "completed": r.completed}
    return {"rig": rig.name, "ttft_budget_s": ttft_budget_s, "best_static_tok_s": best_static_tok_s(rows),
            "rows": [{"label": r.label, "offline": one(r.offline), "online": one(r.online)} for r in rows]}


def _load(load, path: str, option: str):
    """A rig or trace file the user named: one that cannot be read or parsed is a bad option value."""
    try:
        return load(path)
    except (OSError, ValueError) as e:
        raise click.BadParameter(str(e), param_hint=option) from e


@click.command("simulate")
@click.option("--rig", "rig_path", required=True,
              help="Rig profile (JSON), or a shipped one by name: hetero-3card, pcie4-4card.")
@click.option("--trace", "trace_path", required=True,
              help="Arrival trace (JSONL: arrival_s, prompt_tokens, output_tokens[, max_tokens]), "
                   "or the shipped mixed-trace.jsonl.")
@click.option("--ttft-budget-s", type=float, default=5.0, show_default=True,
              help="The time-to-first-token budget of the latency-mode row.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON instead of a table.")
def simulate(rig_path: str, trace_path: str, ttft_budget_s: float, as_json: bool) -> None:
    """Simulate the layout policy, static PP and static TP on a modelled rig and an arrival trace.

    The policy is the engine's own code (engine/policy/decide.py); the rig is a model whose every number is
    labelled in its file. Prints throughput (offline), time to first token (online) and flips."""
    if ttft_budget_s <= 0:
        raise click.BadParameter(f"must be > 0, got {ttft_budget_s}", param_hint="--ttft-budget-s")
    rig = _load(load_rig, rig_path, "--rig")
    trace = _load(load_trace, trace_path, "--trace")
    rows = compare(rig, trace, ttft_budget_s)
    if as_json:
        click.echo(json.dumps(as_dict(rig, rows, ttft_budget_s), indent=2))
    else:
        click.echo(format_table(rig, rows, ttft_budget_s))
