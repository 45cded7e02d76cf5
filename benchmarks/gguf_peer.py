"""phaseflip against llama.cpp on the same GGUF files, quantized ones served as they are (a benchmark, not a
test; `make test` never runs it).

Owns: issue 45's speed rows, each file's workloads run interleaved (phaseflip, then llama.cpp, every round,
same threads): llama-batched-bench's 200-token prompts + 100 new tokens at batch 1 and 32 (--batches: 1 alone
for a model of 1B and up, whose batch 32 takes minutes a round; total tokens over wall seconds, phaseflip's
the same tokens through LLM.generate), llama-bench's tg128 (decode from an
empty cache; phaseflip's (time for 128 new tokens - time for 1) / 127 after a 1-token prompt, the two
lengths alternated, None where noise swamps the difference) and pp512
(prompt tokens over time to first token), and the read bound of batch-1 decode: the bytes a decode token
reads (the engine's own weight report: the blocks as stored) over the bandwidth of a 1 GiB torch.sum read
right before and right after the tg128 step (this machine's bandwidth swings within minutes).
Prints per file each side's range over rounds and the median per-round ratio phaseflip / llama.cpp.
Run: `.venv/bin/python benchmarks/gguf_peer.py --llama-bench BIN --llama-batched-bench BIN FILE.gguf...`
"""
from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

import click

from llamacpp_peer import EXE, _fmt, _log, _median, _run, _span, _timed, llama_bench, median_ratio, pf_decode, read_gbps
from phaseflip.engine.llm import LLM

PROMPT, NEW, TG, PP = 200, 100, 128, 512


def llama_batched(exe: Path, gguf: Path, threads: int, batches: tuple[int, ...]) -> dict[int, float]:
    """{batch: total tok/s} of llama-batched-bench's 200 + 100 at each batch."""
    out = _run([exe, "-m", gguf, "-c", 10240, "-b", 2048, "-ub", 512, "-npp", PROMPT, "-ntg", NEW,
                "-npl", ",".join(map(str, batches)), "-t", threads, "--output-format", "jsonl"])
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {row["pl"]: row["speed"] for row in rows}


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


def boot(path: Path, threads: int, batches: tuple[int, ...], **engine) -> LLM:
    _log(f"booting phaseflip on {path.name}")
    t0 = time.perf_counter()
    # no prefix caching: the rounds repeat their prompts, which llama.cpp computes every time
    llm = LLM(model=str(path), num_threads=threads, max_model_len=1024, enable_prefix_caching=False, **engine)
    for batch in batches:
        _timed(llm, prompts(batch, PROMPT, 0), 2)   # warm-up: every step shape the rounds use
    _timed(llm, prompts(1, PP, 0), 1)
    _log(f"booted in {time.perf_counter() - t0:.1f} s")
    return llm


def decode_bytes(llm: LLM) -> int:
    """The bytes a batch-1 decode token reads, summed over ranks (the weight report of the TP layout, the
    one layout there is at one rank)."""
    reports = [rank["weights"] for rank in llm.inspect()["ranks"]]
    return sum(r["tp" if "tp" in r else next(iter(r))]["bytes_read_per_token"] for r in reports)


def one_round(llm: LLM, path: Path, o: dict) -> dict:
    """{workload: (llama.cpp tok/s, phaseflip tok/s)} and the tg step's read bracket (GB/s before, after):
    llama.cpp runs the GGUF file `path`, phaseflip whatever `llm` serves (the same file, or the checkpoint
    it was converted from)."""
    rows = {}
    pf = {b: b * (PROMPT + NEW) / _timed(llm, prompts(b, PROMPT, 1), NEW) for b in o["batches"]}
    ll = llama_batched(o["llama_batched_bench"], path, o["threads"], o["batches"])
    rows.update({f"{PROMPT}+{NEW} b{b} total": (ll[b], pf[b]) for b in o["batches"]})
    before = read_gbps(o["threads"])
    tg = pf_decode(llm, prompts(1, 1, 2)[0], o["repeats"], TG)
    tests = ["-p", PP, "-n", TG]
    bench = llama_bench(o["llama_bench"], path, tests, o["threads"], o["repeats"])
    bracket = (before, read_gbps(o["threads"]))
    rows[f"tg{TG}"] = (bench[f"tg{TG}"], tg)
    pp = PP / statistics.median(_timed(llm, prompts(1, PP, 3), 1) for _ in range(o["repeats"]))
    rows[f"pp{PP}"] = (bench[f"pp{PP}"], pp)
    return {"rows": rows, "bracket": bracket}


def summarise(rounds: list[dict], nbytes: int) -> dict:
    rows = {}
    for name in rounds[0]["rows"]:
        ll, pf = [r["rows"][name][0] for r in rounds], [r["rows"][name][1] for r in rounds]
        rows[name] = {"llama_cpp": ll, "phaseflip": pf, "ratio": median_ratio(pf, ll)}
    tg = f"tg{TG}"
    bound = {"decode_bytes": nbytes, "bracket_gbps": [r["bracket"] for r in rounds]}
    for i, who in enumerate(("llama_cpp", "phaseflip")):   # each round's tok/s against its own bracket's bound
        bound[f"{who}_fraction_of_bound"] = _median([
            None if r["rows"][tg][i] is None else r["rows"][tg][i] * nbytes / (statistics.mean(r["bracket"]) * 1e9)
            for r in rounds])
    return {"rows": rows, "read_bound": bound}


def print_table(name: str, result: dict, threads: int) -> None:
    click.echo(f"== {name}: phaseflip vs llama.cpp, {threads} threads ==")
    for row, r in result["rows"].items():
        click.echo(f"{row:20} llama.cpp {_span(r['llama_cpp']):>13}  phaseflip {_span(r['phaseflip']):>13}  "
                   f"{_fmt(r['ratio']):>5}x")
    b = result["read_bound"]
    ends = ", ".join(f"{x:.1f}/{y:.1f}" for x, y in b["bracket_gbps"])
    click.echo(f"read bound of tg{TG}: {b['decode_bytes'] / 1e6:.1f} MB a token at {ends} GB/s (before/after, a "
               f"round): phaseflip {_fmt(b['phaseflip_fraction_of_bound'])} of it, llama.cpp "
               f"{_fmt(b['llama_cpp_fraction_of_bound'])}")


def _batches(value: str) -> tuple[int, ...]:
    try:
        batches = tuple(int(b) for b in value.split(","))
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1:
        raise click.BadParameter(f"{value!r}: give batch sizes >= 1, comma-separated (e.g. 1,32)")
    return batches


@click.command()
@click.option("--llama-bench", required=True, type=EXE, help="llama.cpp's built llama-bench.")
@click.option("--llama-batched-bench", required=True, type=EXE, help="llama.cpp's built llama-batched-bench.")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Repetitions of the tg/pp timings a round (llama-bench -r), medians taken.")
@click.option("--batches", default="1,32", show_default=True, callback=lambda _c, _p, v: _batches(v),
              help="The 200+100 workload's batch sizes, comma-separated (1 alone for a large model).")
@click.option("--dtype", default="auto", show_default=True,
              help="phaseflip's activations (LLM's dtype): auto (float32 on the CPU) or bfloat16.")
@click.option("--block-products", type=click.Choice(["auto", "int8", "exact"]), default="auto", show_default=True,
              help="phaseflip's products on blocks (LLM's block_products): x rounded to int8 per block or as it is.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the tables.")
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
def main(llama_bench, llama_batched_bench, threads, rounds, repeats, batches, dtype, block_products, as_json, files):
    """Benchmark phaseflip against llama.cpp on each GGUF file, interleaved, and print the ratios."""
    o = {"llama_bench": llama_bench, "llama_batched_bench": llama_batched_bench, "threads": threads,
         "repeats": repeats, "batches": batches}
    results = {}
    for path in files:
        llm = boot(path, threads, batches, dtype=dtype, block_products=block_products)
        try:
            nbytes = decode_bytes(llm)
            got = []
            for i in range(rounds):
                _log(f"{path.name}: round {i + 1}/{rounds}")
                got.append(one_round(llm, path, o))
        finally:
            llm.shutdown()
        results[path.name] = summarise(got, nbytes)
        if not as_json:
            print_table(path.name, results[path.name], threads)
    if as_json:
        click.echo(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
