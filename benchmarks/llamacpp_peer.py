"""phaseflip against llama.cpp on the same weights (a benchmark, not a test; `make test` never runs it).

Owns: converting the model (default: the embedded SmolLM2-135M-Instruct) to f32 and bf16 GGUFs with
llama.cpp's own converter (cached in --work-dir), running each workload interleaved (phaseflip, then
llama.cpp, every round, same threads) and printing both sides' range over rounds and the median per-round
ratio phaseflip / llama.cpp (> 1: phaseflip faster), with the cores other processes kept busy meanwhile.
Workloads: fp32 batch-1 decode (tg128 at depth 128, -d: both decode after a 128-token prompt;
phaseflip's is (time for 128 new tokens - time for 1) / 127, as bench_engine.single_stream), fp32 prefill of 128 and 512 tokens (pp128/pp512 against prompt tokens over
time to first token), fp32 32 sequences of 128 + 128 tokens (llama-batched-bench's total tokens over wall
seconds and its decode part S_TG; it times 128 decode steps, phaseflip a prefill and 127), bf16 batch-1
decode, and the memory-read bound: weight bytes over a 1 GiB float32 torch.sum's bandwidth in this run,
measured at the end of each round and, because this machine's bandwidth swings by 1.5x within minutes,
also right before and right after each batch-1 decode step (its bracket: each round's fraction of the
bound takes the mean of its two ends).
The converter's interpreter (--convert-python, default this one) needs torch, numpy, transformers and
sentencepiece; phaseflip's .venv lacks only sentencepiece (`.venv/bin/pip install sentencepiece`).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import click
import torch

from phaseflip.engine.llm import LLM
from phaseflip.engine.sampling_params import SamplingParams
from phaseflip.tools.bench_single import single_stream

PROMPT_LENS, NEW_TOKENS, BATCH = (128, 512), 128, 32
CONVERTER = "convert_hf_to_gguf.py"
CONVERTER_NEEDS = "torch, numpy, transformers, sentencepiece"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")
# gguf outtype -> (phaseflip dtype, bytes per parameter, its batch-1 decode row)
DTYPES = {"f32": ("float32", 4, "decode fp32 b1"), "bf16": ("bfloat16", 2, "decode bf16 b1")}


def _log(msg: str) -> None:
    click.echo(f"[{time.strftime('%H:%M:%S')}] {msg}", err=True)


def _cpu_seconds() -> tuple[float, float]:
    """(CPU seconds all processes have used, CPU seconds this process and its waited children have)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:8]]  # user nice system idle iowait irq softirq
    own = os.times()
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), sum(own[:4])


def _others(cpu_start: tuple[float, float], wall_start: float) -> float:
    """Cores other processes kept busy on average since cpu_start (> 0.1 makes this run's figures suspect)."""
    (all_end, own_end), wall = _cpu_seconds(), time.perf_counter() - wall_start
    return max(0.0, (all_end - cpu_start[0]) - (own_end - cpu_start[1])) / wall


def _run(cmd: list[str]) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if proc.returncode != 0:
        raise click.ClickException(f"{' '.join(map(str, cmd))} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


# ---- the model and its GGUFs ----

def _model_dir(model: str | None) -> Path:
    if model is None:
        from phaseflip.engine.checkpoint.default_model import ensure_default_model
        return ensure_default_model()
    missing = [f for f in MODEL_FILES if not (Path(model) / f).is_file()]
    if missing:
        raise click.BadParameter(f"{model!r} lacks {', '.join(missing)}", param_hint="--model")
    return Path(model)


def _find_converter(llama_bench: Path) -> Path:
    for folder in llama_bench.resolve().parents:
        if (folder / CONVERTER).is_file():
            return folder / CONVERTER
    raise click.BadParameter(f"no {CONVERTER} in any folder above {str(llama_bench)!r}; pass --converter",
                             param_hint="--llama-bench")


def _check_convert_python(python: str) -> None:
    proc = subprocess.run([python, "-c", f"import {CONVERTER_NEEDS}"], capture_output=True, text=True)
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise click.BadParameter(f"{python!r} cannot run {CONVERTER} ({why}); it needs {CONVERTER_NEEDS} "
                                 f"({python} -m pip install ...; torch pinned, e.g. torch==2.13.0 for the CPU)",
                                 param_hint="--convert-python")


def ensure_ggufs(model: Path, work_dir: Path, converter: Path, python: str) -> dict[str, Path]:
    """{outtype: gguf}, converting each one that is missing or older than the model's weights."""
    weights_mtime = (model / "model.safetensors").stat().st_mtime
    out, checked = {}, False
    for outtype in DTYPES:
        gguf = work_dir / f"{model.name}-{outtype}.gguf"
        if not gguf.is_file() or gguf.stat().st_mtime < weights_mtime:
            if not checked:
                _check_convert_python(python)
                checked = True
            work_dir.mkdir(parents=True, exist_ok=True)
            _log(f"converting {model} -> {gguf}")
            tmp = gguf.with_suffix(".gguf.tmp")
            _run([python, converter, "--outtype", outtype, "--outfile", tmp, model])
            os.replace(tmp, gguf)
        out[outtype] = gguf
    return out


def weight_bytes(model: Path, bytes_per_param: int) -> int:
    from safetensors import safe_open
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()) * bytes_per_param


# ---- llama.cpp ----

def llama_bench(exe: Path, gguf: Path, tests: list[str], threads: int, reps: int) -> dict[str, float]:
    """{"pp128": tok/s, "tg128": tok/s, ...}: the median of llama-bench's repetitions."""
    out = _run([exe, "-m", gguf, *tests, "-t", threads, "-r", reps, "-o", "json"])
    return {(f"tg{t['n_gen']}" if t["n_gen"] else f"pp{t['n_prompt']}"): statistics.median(t["samples_ts"])
            for t in json.loads(out)}


def llama_batched(exe: Path, gguf: Path, threads: int) -> dict[str, float]:
    out = _run([exe, "-m", gguf, "-c", 8192, "-b", 2048, "-ub", 512, "-npp", PROMPT_LENS[0],
                "-ntg", NEW_TOKENS, "-npl", BATCH, "-t", threads, "--output-format", "jsonl"])
    row = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    return {"total": row["speed"], "decode": row["speed_tg"]}


# ---- phaseflip ----

def _timed(llm: LLM, prompts: list[list[int]], n: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    if any(len(o.outputs[0].token_ids) != n for o in outs):
        raise click.ClickException(f"phaseflip returned fewer than {n} tokens with ignore_eos")
    return seconds


def pf_decode(llm: LLM, prompt: list[int], reps: int, n: int = NEW_TOKENS) -> float | None:
    """Batch-1 decode tokens/s: (time for n tokens - time for 1) over n - 1, runs of the two lengths
    alternated (tools/bench_single.py); None where the machine's noise swamped the difference."""
    out = single_stream(lambda k: _timed(llm, [prompt], k), n, reps)
    if out["tokens_per_s"] is None:
        _log(f"batch-1 decode not measured this round: {out['why_no_per_token']}")
    return out["tokens_per_s"]


def pf_prefill(llm: LLM, prompts: dict[int, list[int]], reps: int) -> dict[str, float]:
    return {f"pp{n}": n / statistics.median(_timed(llm, [p], 1) for _ in range(reps)) for n, p in prompts.items()}


def pf_batched(llm: LLM, prompts: list[list[int]]) -> dict[str, float]:
    first, full = _timed(llm, prompts, 1), _timed(llm, prompts, NEW_TOKENS)
    total = sum(len(p) + NEW_TOKENS for p in prompts)
    return {"total": total / full, "decode": len(prompts) * (NEW_TOKENS - 1) / (full - first)}


def read_gbps(threads: int, gib: float = 1.0, reps: int = 7) -> float:
    """Read bandwidth (GB/s) of torch.sum over a float32 tensor of `gib` GiB, median of `reps`."""
    torch.set_num_threads(threads)
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()  # first touch
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


# ---- the rounds ----

def workloads(tok) -> dict:
    from phaseflip.tools.bench_workload import offline_workload, single_stream_workload
    long = single_stream_workload(tok, prompt_len=max(PROMPT_LENS), max_tokens=NEW_TOKENS).prompts[0]
    batch = offline_workload(tok, BATCH, (PROMPT_LENS[0],) * 2, (NEW_TOKENS,) * 2, seed=2).prompts
    return {"prefill": {n: long[:n] for n in PROMPT_LENS}, "decode": long[:PROMPT_LENS[0]], "batch": batch}


def boot(model: Path, dtype: str, threads: int, compile_mode: str | None, work: dict) -> LLM:
    kw = {} if compile_mode is None else {"compile": compile_mode}
    _log(f"booting phaseflip ({dtype}, {threads} threads{', compile ' + compile_mode if compile_mode else ''})")
    # no prefix caching: the rounds repeat the same prompts, which it would not compute again (llama-bench
    # computes them every time)
    llm = LLM(model=str(model), dtype=dtype, num_threads=threads, max_model_len=1024,
              enable_prefix_caching=False, **kw)
    for prompts, n in (([work["decode"]], 8), ([work["prefill"][max(PROMPT_LENS)]], 2), (work["batch"], 2)):
        _timed(llm, prompts, n)  # warm-up: every step shape the rounds use
    _log_batch1(llm)
    return llm


def _log_batch1(llm: LLM) -> None:
    """What the boot chose for batch-1 decode and the numbers it chose from (the fused layers run eager)."""
    for rank in llm.inspect()["ranks"]:
        for layout, report in rank["compile"].items():
            buckets = report.get("decode", {}).get("buckets", {})
            one = buckets.get(1, buckets.get("1", {}))
            fused = report.get("fused_layers", {})
            _log(f"rank {rank['rank']} {layout}: batch-1 decode {one.get('choice')} (compiled "
                 f"{one.get('compiled_ms')} ms, eager {one.get('eager_ms')} ms); eager layers: "
                 f"{fused.get('choice')}{' (' + fused['reason'] + ')' if fused.get('reason') else ''}")


def step_decode(o: dict, llms: dict, ggufs: dict, work: dict, outtype: str) -> dict[str, tuple]:
    pf = pf_decode(llms[outtype], work["decode"], o["repeats"])
    # at phaseflip's depth: its decode follows a PROMPT_LENS[0]-token prompt, so llama.cpp's tg runs over
    # a cache that deep too (-d; without it, tg starts from an empty cache and reads less KV per token)
    tests = ["-p", 0, "-n", NEW_TOKENS, "-d", len(work["decode"])]
    ll = llama_bench(o["llama_bench"], ggufs[outtype], tests, o["threads"], o["repeats"])
    return {DTYPES[outtype][2]: (ll[f"tg{NEW_TOKENS}"], pf)}


def step_prefill(o: dict, llms: dict, ggufs: dict, work: dict) -> dict[str, tuple]:
    pf = pf_prefill(llms["f32"], work["prefill"], o["repeats"])
    tests = ["-p", ",".join(map(str, PROMPT_LENS)), "-n", 0]
    ll = llama_bench(o["llama_bench"], ggufs["f32"], tests, o["threads"], o["repeats"])
    return {f"prefill fp32 {n}": (ll[f"pp{n}"], pf[f"pp{n}"]) for n in PROMPT_LENS}


def step_batched(o: dict, llms: dict, ggufs: dict, work: dict) -> dict[str, tuple]:
    pf = pf_batched(llms["f32"], work["batch"])
    ll = llama_batched(o["llama_batched_bench"], ggufs["f32"], o["threads"])
    return {f"{BATCH} seqs fp32 {k}": (ll[k], pf[k]) for k in ("total", "decode")}


STEPS = (("decode fp32", partial(step_decode, outtype="f32")), ("prefill fp32", step_prefill),
         (f"{BATCH} sequences fp32", step_batched), ("decode bf16", partial(step_decode, outtype="bf16")))


def one_round(o: dict, llms: dict[str, LLM], ggufs: dict[str, Path], work: dict) -> dict:
    """{"rows": {row: (llama.cpp tok/s, phaseflip tok/s)}, "busy": {row: other processes' cores},
    "read_gbps": ..., "bracket_gbps": {batch-1 decode row: (read GB/s before, after)}}; in every step
    phaseflip runs first, then llama.cpp."""
    rows, busy, bracket = {}, {}, {}
    for name, step in STEPS:
        _log(name)
        before = read_gbps(o["threads"]) if getattr(step, "func", None) is step_decode else None
        start = _cpu_seconds(), time.perf_counter()
        got = step(o, llms, ggufs, work)
        busy.update(dict.fromkeys(got, _others(*start)))
        rows.update(got)
        if before is not None:
            bracket.update(dict.fromkeys(got, (before, read_gbps(o["threads"]))))
    return {"rows": rows, "busy": busy, "read_gbps": read_gbps(o["threads"]), "bracket_gbps": bracket}


def median_ratio(pf: list[float | None], ll: list[float | None]) -> float | None:
    """The median per-round ratio phaseflip / llama.cpp over the rounds where both were measured."""
    pairs = [p / q for p, q in zip(pf, ll) if p is not None and q is not None]
    return statistics.median(pairs) if pairs else None


def _median(values: list[float | None]) -> float | None:
    measured = [v for v in values if v is not None]
    return statistics.median(measured) if measured else None


def summarise(rounds: list[dict], model: Path) -> dict:
    rows = {}
    for name in rounds[0]["rows"]:
        ll, pf = [r["rows"][name][0] for r in rounds], [r["rows"][name][1] for r in rounds]
        rows[name] = {"llama_cpp": ll, "phaseflip": pf, "ratio": median_ratio(pf, ll),
                      "others_busy_cores": max(r["busy"][name] for r in rounds)}
    gbps = statistics.median(r["read_gbps"] for r in rounds)
    bound = {"read_gbps": gbps}
    for outtype, (_, nbytes, row) in DTYPES.items():
        wb = weight_bytes(model, nbytes)
        ms = wb / (gbps * 1e9) * 1e3
        dec = rows[row]
        bound[outtype] = {"weight_bytes": wb, "bound_ms_per_token": ms,
                          "bracket_gbps": [r["bracket_gbps"][row] for r in rounds]}
        for i, who in enumerate(("llama_cpp", "phaseflip")):
            rate = _median(dec[who])
            bound[outtype][f"{who}_ms_per_token"] = None if rate is None else 1e3 / rate
            bound[outtype][f"{who}_fraction_of_bound"] = None if rate is None else ms * rate / 1e3
            # each round's tok/s against the bandwidth read around that very decode step
            bound[outtype][f"{who}_fraction_of_bracket"] = _median([
                None if r["rows"][row][i] is None else
                r["rows"][row][i] * wb / (statistics.mean(r["bracket_gbps"][row]) * 1e9) for r in rounds])
    return {"rows": rows, "bound": bound}


def _span(v: list[float | None]) -> str:
    """The range over rounds; a round not measured counts as 'n/m' (not measured)."""
    measured = [x for x in v if x is not None]
    missing = len(v) - len(measured)
    span = ("" if not measured else f"{measured[0]:.1f}" if len(measured) == 1
            else f"{min(measured):.1f}-{max(measured):.1f}")
    return span + (f"{', ' if span else ''}{missing} n/m" if missing else "")


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "None" if x is None else format(x, spec)


def print_table(result: dict) -> None:
    c = result["config"]
    click.echo(f"== phaseflip vs llama.cpp: {c['model']}, {c['threads']} threads, {c['rounds']} round(s), "
               f"other processes busy {c['other_processes_cores']:.2f} cores ==")
    click.echo(f"{'workload (tok/s)':24} {'llama.cpp':>17} {'phaseflip':>17} {'ratio':>6}  others busy")
    for name, r in result["rows"].items():
        click.echo(f"{name:24} {_span(r['llama_cpp']):>17} {_span(r['phaseflip']):>17} {_fmt(r['ratio']):>5}x  "
                   f"{r['others_busy_cores']:.2f} cores")
    b = result["bound"]
    click.echo(f"memory-read bound (torch.sum of 1 GiB fp32, {c['threads']} threads: {b['read_gbps']:.2f} GB/s):")
    for outtype in DTYPES:
        d = b[outtype]
        click.echo(f"  {outtype:4} {d['weight_bytes'] / 1e6:.0f} MB -> {d['bound_ms_per_token']:.2f} ms/token; "
                   f"phaseflip {_fmt(d['phaseflip_ms_per_token'])} ms/token ({_fmt(d['phaseflip_fraction_of_bound'])} "
                   f"of bound), llama.cpp {_fmt(d['llama_cpp_ms_per_token'])} ({_fmt(d['llama_cpp_fraction_of_bound'])})")
        ends = ", ".join(f"{a:.1f}/{b:.1f}" for a, b in d["bracket_gbps"])
        click.echo(f"       read right before/after the step ({ends} GB/s a round): phaseflip "
                   f"{_fmt(d['phaseflip_fraction_of_bracket'])} of that bound, llama.cpp "
                   f"{_fmt(d['llama_cpp_fraction_of_bracket'])} (median over rounds)")


EXE = click.Path(exists=True, dir_okay=False, executable=True, path_type=Path)


@click.command()
@click.option("--llama-bench", required=True, type=EXE, help="llama.cpp's built llama-bench.")
@click.option("--llama-batched-bench", required=True, type=EXE, help="llama.cpp's built llama-batched-bench.")
@click.option("--converter", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help=f"llama.cpp's {CONVERTER} (default: found in a folder above --llama-bench).")
@click.option("--convert-python", type=EXE, default=sys.executable, show_default=True,
              help=f"Interpreter for the converter; needs {CONVERTER_NEEDS}.")
@click.option("--model", type=click.Path(exists=True, file_okay=False),
              help="HF-format model directory (default: the embedded SmolLM2-135M-Instruct).")
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the GGUFs are cached (default: MODEL-gguf next to the model).")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Repetitions per round of the batch-1 and prefill timings (llama-bench -r), medians taken.")
@click.option("--compile", "compile_mode", type=click.Choice(["auto", "on", "off"]),
              help="phaseflip's compile= (default: LLM's own).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def main(llama_bench, llama_batched_bench, converter, convert_python, model, work_dir, threads, rounds, repeats,
         compile_mode, as_json):
    """Benchmark phaseflip against llama.cpp on the same weights, interleaved, and print the ratios."""
    converter = converter or _find_converter(llama_bench)
    model_dir = _model_dir(model)
    ggufs = ensure_ggufs(model_dir, work_dir or model_dir.parent / f"{model_dir.name}-gguf", converter,
                         str(convert_python))
    opts = {"llama_bench": llama_bench, "llama_batched_bench": llama_batched_bench, "threads": threads,
            "repeats": repeats}
    cpu_start, wall_start = _cpu_seconds(), time.perf_counter()
    from phaseflip.engine.checkpoint.tokenizer import load_tokenizer
    work = workloads(load_tokenizer(str(model_dir)))
    llms = {o: boot(model_dir, dt, threads, compile_mode, work) for o, (dt, _, _) in DTYPES.items()}
    try:
        results = []
        for i in range(rounds):
            _log(f"round {i + 1}/{rounds}")
            results.append(one_round(opts, llms, ggufs, work))
    finally:
        for llm in llms.values():
            llm.shutdown()
    result = {"config": {"model": str(model_dir), "ggufs": {k: str(v) for k, v in ggufs.items()},
                         "threads": threads, "rounds": rounds, "repeats": repeats, "compile": compile_mode,
                         "other_processes_cores": _others(cpu_start, wall_start)},
              **summarise(results, model_dir)}
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
