"""`phaseflip bench`: the engine against HuggingFace transformers, measured side by side in one run.

Owns: building the workloads once, running the engine (in this process) and HF transformers (in a
subprocess, same model, fp32, same thread count) on them, and printing the ratios as a table (or JSON).
The timing itself lives in bench_engine.py and bench_hf.py; the workloads in bench_workload.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import click
import torch

from phaseflip.tools import bench_engine
from phaseflip.tools.bench_workload import offline_workload, shared_prefix_workload, single_stream_workload

PARTS = ("offline", "single", "prefix", "flips")
FLIP_PROMPTS = [f"Tell me a short story about the number {i}." for i in range(8)]


def _run_hf(model_dir: str, work: dict, threads: int, batch_size: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(work, f)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    try:
        proc = subprocess.run([sys.executable, "-m", "phaseflip.tools.bench_hf", model_dir, f.name,
                               "--threads", str(threads), "--batch-size", str(batch_size)],
                              capture_output=True, text=True, env=env)
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        raise click.ClickException(f"the HF transformers run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def _pair(hint: str, text: str, ordered: bool = True) -> tuple[int, int]:
    """Two positive integers 'A,B' (A <= B when ordered), or a clear error naming the option."""
    try:
        a, b = (int(v) for v in text.split(","))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not two integers A,B", param_hint=hint) from None
    if a < 1 or b < 1 or (ordered and a > b):
        raise click.BadParameter(f"{text!r} is invalid: need two integers >= 1" + (", low first" if ordered else ""),
                                 param_hint=hint)
    return a, b


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _compare(engine: dict, hf: dict | None) -> dict:
    out: dict = {}
    if "offline" in engine:
        e, h = engine["offline"], (hf or {}).get("offline")
        same = (sum(a == b for a, b in zip(e["token_ids"], h["token_ids"])) if h else None)
        out["offline"] = {"engine_tok_s": e["tokens_per_s"], "hf_tok_s": h and h["tokens_per_s"],
                          "ratio": _ratio(e["tokens_per_s"], h and h["tokens_per_s"]),
                          "output_tokens": e["output_tokens"], "equal_to_hf": same,
                          "requests": len(e["token_ids"]), "hf_batch_size": h and h["batch_size"]}
    if "single" in engine:
        e, h = engine["single"], (hf or {}).get("single")
        out["single"] = {"engine": e, "hf": h,
                         "decode_ratio": _ratio(e["tokens_per_s"], h and h["tokens_per_s"]),
                         "ttft_ratio": _ratio(e["ttft_ms"], h and h["ttft_ms"])}
    return out


def _prefix(model_dir: str, threads: int, work, max_len: int, tok, hf_batch_size: int, no_hf: bool) -> dict:
    """The shared-prefix batch: the engine with prefix caching on and off, and HF, in one run."""
    runs = bench_engine.run_prefix(model_dir, threads, work, max_len)
    hf = None if no_hf else _run_hf(model_dir, {"pad_id": tok.eos_token_id or 0, "offline": work.to_json(),
                                                "single": None}, threads, hf_batch_size)["offline"]
    on, off = runs["on"], runs["off"]
    return {"requests": len(work.prompts), "prompt_tokens": sum(len(p) for p in work.prompts),
            "output_tokens": work.output_tokens,
            "on_tok_s": on["tokens_per_s"], "off_tok_s": off["tokens_per_s"], "hf_tok_s": hf and hf["tokens_per_s"],
            "on_vs_off": _ratio(on["tokens_per_s"], off["tokens_per_s"]),
            "on_vs_hf": _ratio(on["tokens_per_s"], hf and hf["tokens_per_s"]),
            "on_equal_to_off": sum(a == b for a, b in zip(on["token_ids"], off["token_ids"])),
            "prefix_cache": on["prefix_cache"]}


def _print_prefix(p: dict) -> None:
    def f(x, spec=".1f"):
        return "n/a" if x is None else format(x, spec)
    pc = p["prefix_cache"]
    click.echo(f"shared prefix: {p['requests']} requests ({p['prompt_tokens']} prompt tokens, {p['output_tokens']} "
               f"output): caching on {f(p['on_tok_s'])} tok/s, off {f(p['off_tok_s'])} tok/s -> "
               f"{f(p['on_vs_off'], '.2f')}x; HF {f(p['hf_tok_s'])} tok/s -> {f(p['on_vs_hf'], '.2f')}x; "
               f"prompt tokens computed {pc['prompt_tokens_computed']}, reused {pc['prompt_tokens_reused']} "
               f"(hit rate {f(pc['hit_rate'], '.2f')}); outputs equal on/off: {p['on_equal_to_off']}/{p['requests']}")


def _print_table(threads: int, cmp: dict, flips: dict | None, boot_ms: dict) -> None:
    def f(x, spec=".1f"):
        return "n/a" if x is None else format(x, spec)
    click.echo(f"== phaseflip bench: fp32, {threads} threads ==")
    if "offline" in cmp:
        o = cmp["offline"]
        click.echo(f"offline {o['requests']} prompts, {o['output_tokens']} output tokens: engine "
                   f"{f(o['engine_tok_s'])} tok/s, HF {f(o['hf_tok_s'])} tok/s (batch {o['hf_batch_size']}, "
                   f"left padding) -> {f(o['ratio'], '.2f')}x; greedy outputs equal to HF's: "
                   f"{o['equal_to_hf']}/{o['requests']}")
    if "single" in cmp:
        s = cmp["single"]
        e, h = s["engine"], s["hf"] or {}
        click.echo(f"single stream: decode engine {f(e['ms_per_token'])} ms/tok ({f(e['tokens_per_s'])} tok/s), "
                   f"HF {f(h.get('ms_per_token'))} ms/tok -> {f(s['decode_ratio'], '.2f')}x; TTFT engine "
                   f"{f(e['ttft_ms'])} ms, HF {f(h.get('ttft_ms'))} ms -> {f(s['ttft_ratio'], '.2f')} of HF's")
    if boot_ms:
        click.echo("boot (1 rank): " + ", ".join(f"{k} {v:.0f} ms" for k, v in boot_ms.items()))
    if flips:
        click.echo(f"flips ({flips['world_size']} ranks, park always; memcpy {flips['memcpy_gbps']:.2f} GB/s "
                   f"this run); boot: " + ", ".join(f"{k} {v:.0f} ms" for k, v in flips["boot_ms"].items()))
        def pack(r):
            return (f"{r['bytes'] / 1e6:.0f} MB in {f(r['pack_ms'])} ms = {f(r['gbps'], '.2f')} GB/s "
                    f"({f(r['of_memcpy'], '.0%')} of memcpy, {f(r['of_first_touch'], '.0%')} of first touch)")
        click.echo(f"  pack (host images at boot; first touch of new memory {flips['first_touch_gbps']:.2f} GB/s "
                   f"this run): all ranks {pack(flips['pack']['all'])}; "
                   + "; ".join(f"rank {r['rank']} {pack(r)}" for r in flips["pack"]["ranks"]))
        click.echo(f"  {'dir':7} {'total':>7} " + " ".join(f"{c:>8}" for c in bench_engine.FLIP_PARTS)
                   + f" {'MB':>7} {'chunks':>6} {'floor':>7} {'ratio':>6} {'<=1.5x+10ms':>11} {'busiest':>8}")
        for r in flips["flips"]:
            click.echo(f"  {r['direction']:7} {r['total_ms']:7.1f} "
                       + " ".join(f"{f(r[c + '_ms']):>8}" for c in bench_engine.FLIP_PARTS)
                       + f" {r['bytes_moved'] / 1e6:7.1f} {r['chunks']:6d} {r['floor_ms']:7.1f} {f(r['ratio'], '.2f'):>6}"
                       + f" {'yes' if r['within_target'] else 'NO':>11} {r['busiest_rank_floor_ms']:8.1f}")
        ratios = sorted(r["ratio"] for r in flips["flips"] if r["ratio"] is not None)
        if ratios:
            click.echo(f"  median ratio {ratios[len(ratios) // 2]:.2f}; within 1.5x floor + 10 ms: "
                       f"{sum(r['within_target'] for r in flips['flips'])}/{len(flips['flips'])} "
                       "(floor: all ranks' bytes over the host memcpy bandwidth; 'busiest': one rank's alone)")


@click.command()
@click.option("--model", default=None, help="HF-format model directory (default: the embedded SmolLM2-135M-Instruct).")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Threads for both engines (default: torch's).")
@click.option("--num-prompts", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--prompt-len", default="16,512", show_default=True, help="Offline prompt lengths: LOW,HIGH tokens.")
@click.option("--output-len", default="16,128", show_default=True, help="Offline output lengths: LOW,HIGH tokens.")
@click.option("--single-len", default="128,64", show_default=True,
              help="Single stream: PROMPT,OUTPUT tokens (OUTPUT >= 2).")
@click.option("--hf-batch-size", type=click.IntRange(min=1), default=16, show_default=True,
              help="HF's batch (its best measured on 2 cores; see the README).")
@click.option("--parts", default=",".join(PARTS), show_default=True, help="Which parts to run.")
@click.option("--no-hf", is_flag=True, help="Skip HF transformers (engine figures only).")
@click.option("--prefix-len", type=click.IntRange(min=1), default=400, show_default=True,
              help="Shared-prefix batch: the system prompt's and each document's length in tokens.")
@click.option("--flip-world-size", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--flip-staging-mib", type=click.FloatRange(min=0, min_open=True), default=None,
              help="The flips' KV staging (send + receive), MiB (default: the engine's).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def bench(model, threads, num_prompts, prompt_len, output_len, single_len, hf_batch_size, parts, no_hf,
          prefix_len, flip_world_size, flip_staging_mib, as_json):
    """Offline throughput, single-stream decode and TTFT against HF transformers; flips against their copy floor."""
    prompt_len, output_len = _pair("--prompt-len", prompt_len), _pair("--output-len", output_len)
    single_prompt, single_out = _pair("--single-len", single_len, ordered=False)
    if single_out < 2:
        raise click.BadParameter(f"output {single_out} is too short: ms per token needs >= 2", param_hint="--single-len")
    chosen = tuple(p for p in parts.split(",") if p)
    bad = [p for p in chosen if p not in PARTS]
    if bad:
        raise click.BadParameter(f"unknown part(s) {bad}; allowed: {','.join(PARTS)}", param_hint="--parts")
    threads = threads or torch.get_num_threads()
    from phaseflip.engine.checkpoint.default_model import ensure_default_model
    from phaseflip.engine.checkpoint.tokenizer import load_tokenizer
    model_dir = str(model or ensure_default_model())
    tok = load_tokenizer(model_dir)
    off = offline_workload(tok, num_prompts, prompt_len, output_len) if "offline" in chosen else None
    single = single_stream_workload(tok, single_prompt, single_out) if "single" in chosen else None
    shared = shared_prefix_workload(tok, system_len=prefix_len, doc_len=prefix_len) if "prefix" in chosen else None
    max_len = max([len(p) + m for w in (off, single, shared) if w for p, m in zip(w.prompts, w.max_tokens)]
                  + [256])
    engine = bench_engine.run_single_rank(model_dir, threads, off, single, max_len) if off or single else {}
    hf = None
    if not no_hf and (off or single):
        work = {"pad_id": tok.eos_token_id or 0, "offline": off and off.to_json(), "single": single and single.to_json()}
        hf = _run_hf(model_dir, work, threads, hf_batch_size)
    prefix = _prefix(model_dir, threads, shared, max_len, tok, hf_batch_size, no_hf) if shared else None
    flips = (bench_engine.run_flips(model_dir, flip_world_size, 4, FLIP_PROMPTS, max_len, flip_staging_mib)
             if "flips" in chosen else None)
    cmp = _compare(engine, hf)
    if as_json:
        click.echo(json.dumps({"threads": threads, "compare": cmp, "engine_boot_ms": engine.get("boot_ms"),
                               "prefix": prefix, "flips": flips,
                               "hf_transformers": hf and hf.get("transformers")}, indent=1))
    else:
        _print_table(threads, cmp, flips, engine.get("boot_ms"))
        if prefix:
            _print_prefix(prefix)
