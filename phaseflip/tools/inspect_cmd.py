"""`phaseflip inspect`: what was captured, where every byte went, what each flip cost — for a person.

Owns: reading a boot manifest (or booting to get one), printing it as tables (captured steps per
layout and phase, the ledger per rank for both layouts side by side, how each rank's weights are
stored and what a decode token reads, the boot timeline, the flips),
`--json`, `--svg FILE` (tools/svg.py) and `--dot FILE` (tools/dot.py).
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import click

from phaseflip.cache import cache_dir

LEDGER_TERMS = ("arena", "kv_usable", "kv_unusable", "graph_pool", "compiled_code", "static_buffers",
                "staging_reserve", "host_images", "allocator_cache", "framework_overhead", "unexplained", "free")


def default_manifest_path() -> Path:
    return cache_dir() / "last-manifest.json"


def _mib(v) -> str:
    return "null" if v is None else f"{v / 2**20:,.1f}"


def steps_table(m: dict) -> list[str]:
    groups = defaultdict(list)
    for st in m["steps"]:
        if st["rank"] == 0:
            groups[(st["layout"], st["phase"], st["backend"])].append(st)
    lines = ["captured steps (rank 0; every rank captures the same buckets):"]
    for (layout, phase, backend), steps in sorted(groups.items()):
        buckets = ",".join(str(s["bucket"]) for s in sorted(steps, key=lambda s: s["bucket"]))
        ms = sum(s["capture_ms"] for s in steps)
        pool = [s["pool_bytes"] for s in steps]
        pool_txt = ("none (off CUDA: the ledger's graph_pool is the GEMM warm-up)" if backend != "cuda" else
                    "null" if any(p is None for p in pool) else _mib(sum(pool)) + " MiB")
        lines.append(f"  {layout:3} {phase:8} {backend:9} {len(steps):3} steps  buckets {buckets}  "
                     f"capture {ms:.1f} ms  pool {pool_txt}")
    lines.append(f"  total {len(m['steps'])} steps over {m['world_size']} rank(s); eager fallbacks so far: "
                 f"{m['eager_fallbacks'] or 'none'}; run as chunks of the largest bucket: "
                 f"{m.get('chunked_runs') or 'none'}; PP steps run as micro-batches (at most "
                 f"{m.get('pp_micro_batches')} pieces): {m.get('micro_batched_runs') or 'none'}")
    return lines


def ledger_table(m: dict) -> list[str]:
    layouts = list(m["layouts"])
    names = [f"rank {r['rank']} {lay}" for r in m["ranks"] for lay in layouts]
    head = f"  {'MiB':20}" + "".join(f"{n:>16}" for n in names)
    lines = ["memory ledger per rank and layout (sums to the budget; null = not measured):", head]
    for term in ("budget",) + LEDGER_TERMS:
        lines.append(f"  {term:20}" + "".join(f"{_mib(r['ledger'][lay][term]):>16}"
                                              for r in m["ranks"] for lay in layouts))
    lines.append(f"  {'sums to budget':20}" + "".join(f"{str(r['ledger'][lay]['sums_to_budget']):>16}"
                                                      for r in m["ranks"] for lay in layouts))
    return lines


def weights_table(m: dict) -> list[str]:
    """Each rank's weights per layout: MiB per storage type and the MiB one decode token reads."""
    lines = ["weights per rank and layout (MiB by storage; read per decode token):"]
    for r in m["ranks"]:
        for lay, w in (r.get("weights") or {}).items():   # absent from older manifests
            kinds = ", ".join(f"{k} {_mib(v)}" for k, v in sorted(w["bytes_by_storage"].items()))
            blocks = f"; blocks multiply x {w['block_products_x']}" if w.get("block_products_x") else ""
            read = _mib(w["bytes_read_per_token"])
            lines.append(f"  rank {r['rank']} {lay:3} {kinds}; read per token {read}{blocks}")
    return lines


def boot_table(m: dict) -> list[str]:
    lines = ["boot timeline (ms):", "  controller: " + ", ".join(f"{k} {v:.0f}" for k, v in m["boot_ms"].items())]
    for r in m["ranks"]:
        lines.append(f"  rank {r['rank']}: " + ", ".join(f"{k} {v:.0f}" for k, v in r["boot_ms"].items()))
        for lay, roles in r["compile"].items():
            for role, c in roles.items():
                if role == "record":
                    lines.append(f"    {lay} choices: {_record_line(c)}")
                    continue
                extra = ", ".join(f"{k} {v:.1f}" for k, v in c.items() if isinstance(v, float))
                lines.append(f"    {lay} {role}: {c['choice']}" + (f" ({extra})" if extra else "")
                             + (f" — {c['reason']}" if c.get("reason") is not None else ""))
                lines += [f"      bucket {b}: {_timed_choice(t)}" for b, t in c.get("buckets", {}).items()]
                if "saved_steps" in c:
                    st = c["saved_steps"]
                    lines.append(f"      saved graphs: {len(st['loaded'])} loaded in {st['load_ms']:.0f} ms, "
                                 f"{len(st['compiled'])} compiled in {st['compile_ms']:.0f} ms ({st['dir']})")
                if "own_rows" in c:
                    own = c["own_rows"]
                    lines.append(f"      steps run over their own token rows, not the bucket's: {own['runs']}"
                                 + (f"; rows no saved graph serves (the bucket replayed): {own['unserved']}"
                                    if own["unserved"] else ""))
    return lines


def _record_line(c: dict) -> str:
    """Where a layout's boot took its choices from: the record of an earlier boot, or measurement."""
    if c["used"]:
        return f"from the record made {c['made_at']} (nothing measured): {c['path']}"
    return f"measured at this boot, recorded in {c['path']}"


def _timed_choice(t: dict) -> str:
    def ms(v):
        return "n/a" if v is None else f"{v:.1f}"
    if "reason" in t:   # chosen by a rule, not timed
        return f"{t['choice']} ({t['reason']})"
    return f"{t['choice']} (compiled {ms(t['compiled_ms'])} ms, eager {ms(t['eager_ms'])} ms)"


def policy_line(m: dict) -> list[str]:
    """Where the policy's rates and flip costs started from (absent from older manifests)."""
    if "policy_record" not in m:
        return []
    rec = m["policy_record"]
    if rec is None:
        return ["policy record: none (one layout, forced flips or the drain rule: nothing is priced)"]
    if rec["used"]:
        return [f"policy rates and flip costs: seeded from the record made {rec['made_at']}: {rec['path']}"]
    return [f"policy rates and flip costs: measured in this run, kept at shutdown in {rec['path']}"]


def flips_table(m: dict) -> list[str]:
    if not m["flips"]:
        return ["flips: none yet"]
    total = m.get("num_flips", 0) + m.get("num_failed_flips", 0)  # absent from older manifests
    shown = f"{len(m['flips'])}" if total <= len(m["flips"]) else f"the last {len(m['flips'])} of {total}"
    lines = [f"flips ({shown}):", f"  {'direction':10}{'total':>9}{'read':>8}{'exch':>8}{'refill':>8}"
             f"{'write':>8}{'cut':>7}{'kv MiB':>9}{'w MiB':>9}  result"]
    for e in m["flips"]:
        def f(k):
            return f"{e[k]:.1f}" if e.get(k) is not None else "-"
        lines.append(f"  {e['direction']:10}{e['total_ms']:9.1f}{f('read_ms'):>8}{f('exchange_ms'):>8}"
                     f"{f('refill_ms'):>8}{f('write_ms'):>8}{f('cutover_ms'):>7}{_mib(e['kv_bytes']):>9}"
                     f"{_mib(e['weight_bytes']):>9}  {'ok' if e['ok'] else 'FAILED at ' + _where(e)}")
    return lines


def _where(e: dict) -> str:
    chunk = e.get("failed_chunk")
    return str(e["failed_stage"]) + ("" if chunk is None else f" (chunk {chunk} of {e['chunks']})")


def shard_text(s: dict) -> str:
    """One rank's shard of a layout, as the manifest gives it."""
    experts = "".join(f" {label} {s[key][0]}-{s[key][1]}" for key, label in
                      (("expert_mlp", "each expert"), ("shared_mlp", "shared expert")) if s.get(key, [0, 0])[1])
    return (f"rank {s['rank']} layers {s['layers'][0]}-{s['layers'][1]} kv heads {s['kv_heads'][0]}-"
            f"{s['kv_heads'][1]} mlp {s['mlp'][0]}-{s['mlp'][1]}{experts}")


def render_text(m: dict) -> str:
    head = [f"phaseflip manifest: {m['model']['dir']} ({m['model']['architecture']}, {m['dtype']}, "
            f"{m['device']}), world size {m['world_size']}, layouts {','.join(m['layouts'])}, "
            f"active {m['active_layout']}; KV {m['kv']['num_blocks']} blocks of {m['kv']['block_size']}"]
    for lay, shards in m["layouts"].items():
        head.append(f"  {lay}: " + "; ".join(shard_text(s) for s in shards))
    head += [f"  note: {n}" for n in m["plan"]["notes"]]
    pc = m.get("prefix_cache")  # absent from older manifests
    if pc and pc.get("enabled"):
        rate = "n/a" if pc["hit_rate"] is None else f"{pc['hit_rate']:.2f}"
        head.append(f"  prefix cache: prompt tokens computed {pc['prompt_tokens_computed']}, reused "
                    f"{pc['prompt_tokens_reused']} (hit rate {rate}); {pc['cached_blocks']} blocks cached, "
                    f"{pc['evictions']} evicted")
    elif pc is not None:
        head.append("  prefix cache: off")
    sections = [head, steps_table(m), ledger_table(m), weights_table(m), boot_table(m),
                policy_line(m) + flips_table(m)]
    return "\n\n".join("\n".join(s) for s in sections)


def _boot_manifest(model, world_size, layouts) -> dict:
    from phaseflip.engine.llm import LLM
    with LLM(model=model, world_size=world_size, layouts=tuple(layouts.split(",")) if layouts else None) as llm:
        return llm.inspect()


@click.command("inspect")
@click.argument("manifest", required=False, type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@click.option("--svg", "svg_path", type=click.Path(dir_okay=False), help="Draw memory bars and flip timelines here.")
@click.option("--dot", "dot_path", type=click.Path(dir_okay=False),
              help="Write the layouts, their captured steps and the flips as Graphviz text here.")
@click.option("--model", default=None, help="Boot this model (HF dir; default the embedded one) and inspect it.")
@click.option("--world-size", type=int, default=None, help="With --model/--boot: ranks.")
@click.option("--layouts", default=None, help="With --model/--boot: pp,tp | pp | tp.")
@click.option("--boot", "do_boot", is_flag=True, help="Boot (the default model unless --model) instead of reading a file.")
def inspect(manifest, as_json, svg_path, dot_path, model, world_size, layouts, do_boot):
    """Show what a boot captured and where memory went. MANIFEST defaults to the last boot's."""
    for hint, out in (("--svg", svg_path), ("--dot", dot_path)):
        if out and not Path(out).resolve().parent.is_dir():
            raise click.BadParameter(f"{out}: its directory {Path(out).resolve().parent} does not exist",
                                     param_hint=hint)
    if model or do_boot or world_size is not None:
        m = _boot_manifest(model, 1 if world_size is None else world_size, layouts)
    else:
        path = Path(manifest) if manifest else default_manifest_path()
        if not path.is_file():
            raise click.BadParameter(f"no manifest at {path}: run `phaseflip boot` first, or pass --model DIR",
                                     param_hint="MANIFEST")
        try:
            m = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise click.BadParameter(f"{path} is not a boot manifest (one JSON object, as `phaseflip boot` "
                                     f"writes): {e}", param_hint="MANIFEST") from None
        if not isinstance(m, dict):
            raise click.BadParameter(f"{path} is not a boot manifest: a JSON {type(m).__name__}, not an object",
                                     param_hint="MANIFEST")
    if svg_path:
        from phaseflip.tools.svg import render_svg
        Path(svg_path).write_text(render_svg(m))
        click.echo(f"wrote {svg_path}")
    if dot_path:
        from phaseflip.tools.dot import render_dot
        Path(dot_path).write_text(render_dot(m))
        click.echo(f"wrote {dot_path}")
    click.echo(json.dumps(m, indent=2) if as_json else render_text(m))
