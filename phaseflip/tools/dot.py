"""A manifest as Graphviz text: the layouts, the steps each captured, and the flips between them.

Owns: `render_dot(manifest) -> str` (`phaseflip inspect --dot FILE`; `dot -Tsvg FILE` draws it). One
node per layout (its shards: layers, kv heads and MLP share per rank), one node per captured step of
rank 0 (every rank captures the same buckets) with its backend and capture time, and one edge per flip
direction with the flips the manifest's log holds: count, failures, median total and its components.
No dependency beyond the standard library.
"""
from __future__ import annotations

import statistics
from collections import defaultdict

from phaseflip.tools.inspect_cmd import shard_text

COMPONENTS = ("read_ms", "exchange_ms", "refill_ms", "write_ms", "cutover_ms")


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _layout_label(name: str, shards: list[dict]) -> str:
    return "\n".join([f"layout {name}", *(shard_text(s) for s in shards)])


def _step_lines(m: dict) -> list[str]:
    lines = []
    for st in sorted((s for s in m["steps"] if s["rank"] == 0), key=lambda s: (s["layout"], s["phase"], s["bucket"])):
        node = f"{st['layout']}:{st['phase']}:{st['bucket']}"
        label = f"{st['phase']} {st['bucket']}\n{st['backend']}, capture {st['capture_ms']:.1f} ms"
        lines.append(f"  {_quote(node)} [shape=ellipse, label={_quote(label)}];")
        lines.append(f"  {_quote('layout ' + st['layout'])} -> {_quote(node)} [arrowhead=none, color=gray];")
    return lines


def _flip_lines(m: dict) -> list[str]:
    by_direction = defaultdict(list)
    for e in m["flips"]:
        by_direction[e["direction"]].append(e)
    lines = []
    for direction, entries in sorted(by_direction.items()):
        source, target = direction.split("->")
        ok = [e for e in entries if e["ok"]]
        label = [f"{direction}: {len(entries)} flip(s), {len(entries) - len(ok)} failed"]
        if ok:
            label.append(f"median {statistics.median(e['total_ms'] for e in ok):.1f} ms")
            parts = [f"{k[:-3]} {statistics.median(e[k] for e in ok if e.get(k) is not None):.1f}"
                     for k in COMPONENTS if any(e.get(k) is not None for e in ok)]
            label.append(", ".join(parts))
        lines.append(f"  {_quote('layout ' + source)} -> {_quote('layout ' + target)} "
                     f"[style=bold, color=red, label={_quote(chr(10).join(label))}];")
    return lines


def render_dot(m: dict) -> str:
    title = (f"{m['model']['dir']} ({m['model']['architecture']}, {m['dtype']}, {m['device']}), "
             f"world size {m['world_size']}, active {m['active_layout']}")
    lines = ["digraph phaseflip {", "  rankdir=LR;", f"  label={_quote(title)};", "  node [fontsize=10];"]
    lines += [f"  {_quote('layout ' + name)} [shape=box, style=filled, fillcolor=lightblue, "
              f"label={_quote(_layout_label(name, shards))}];" for name, shards in m["layouts"].items()]
    lines += _step_lines(m) + _flip_lines(m)
    total = m.get("num_flips", 0) + m.get("num_failed_flips", 0)
    if total > len(m["flips"]):
        lines.append(f"  // the manifest's flip log holds the last {len(m['flips'])} of {total} flips")
    lines.append("}")
    return "\n".join(lines) + "\n"
