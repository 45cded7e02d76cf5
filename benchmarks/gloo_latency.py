"""gloo's latency between rank processes, with its device thread as it starts and under SCHED_BATCH.

Owns: a measurement (not a test) of what rank/comm.py's `batch_gloo_loops` changes. Rounds alternate
the two settings (PHASEFLIP_GLOO_BATCH=0, the default, and 1). `--hog` runs a busy process at nice 19
per core meanwhile (other work on the cores, as a shared machine or a test suite's background jobs). Each round starts 2 processes joined by
`init_group` (the engine's own set-up, one thread each as a rank of a 2-core machine gets) and times,
after a warm-up, single calls: an all_reduce of a decode step's rows (`--rows` x `--hidden` fp32) and a
send/recv round trip of the same tensor; it prints percentiles and the mean in microseconds. With
`--engine`, each round also decodes with the embedded SmolLM2 over 2 ranks, TP only and PP only
(fp32, compile off, 8 x 32-token prompts + `--new` tokens at batch 1 and 8) and prints output tok/s.
Usage: `.venv/bin/python benchmarks/gloo_latency.py [--rounds 3] [--engine] [--hog]`.
"""
from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time

import click
import torch
import torch.multiprocessing as mp

SETTINGS = {"as started": "0", "batch": "1"}


def _time_calls(fn, calls: int, warm: int = 50) -> list[float]:
    for _ in range(warm):
        fn()
    out = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6)
    return out


def _rank(rank: int, port: int, rows: int, hidden: int, calls: int, out) -> None:
    import torch.distributed as dist
    from phaseflip.rank.comm import init_group
    torch.set_num_threads(1)
    init_group(rank, 2, "cpu", f"tcp://127.0.0.1:{port}", timeout_s=120)
    x = torch.ones(rows, hidden)

    def round_trip():
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)
    reduce_us = _time_calls(lambda: dist.all_reduce(x), calls)
    trip_us = _time_calls(round_trip, calls)
    if rank == 0:
        out.put({"all_reduce": reduce_us, "send/recv round trip": trip_us})
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collectives(rows: int, hidden: int, calls: int) -> dict[str, list[float]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, rows, hidden, calls, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    result = out.get(timeout=300)
    for p in procs:
        p.join(60)
    return result


def _engine(new: int) -> dict[str, float]:
    from phaseflip import LLM, SamplingParams
    from phaseflip.engine.checkpoint.default_model import ensure_default_model
    prompts = [[100 + i] * 32 for i in range(8)]
    rates = {}
    for layout in ("tp", "pp"):
        with LLM(model=str(ensure_default_model()), dtype="float32", compile="off", max_num_seqs=8,
                 world_size=2, layouts=(layout,), max_model_len=512) as llm:
            for n in (1, 8):
                llm.generate(prompts[:n], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                             use_tqdm=False)
                t = time.perf_counter()
                llm.generate(prompts[:n], SamplingParams(temperature=0, max_tokens=new, ignore_eos=True),
                             use_tqdm=False)
                rates[f"{layout} batch {n}"] = n * new / (time.perf_counter() - t)
    return rates


def _summary(us: list[float]) -> str:
    s = sorted(us)
    pick = [s[min(len(s) - 1, int(len(s) * q))] for q in (0.1, 0.5, 0.9, 0.99)]
    return "p10/p50/p90/p99 " + " / ".join(f"{v:.0f}" for v in pick) + f", mean {statistics.fmean(us):.0f}"


@click.command()
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--rows", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--hidden", type=click.IntRange(min=1), default=576, show_default=True)
@click.option("--calls", type=click.IntRange(min=10), default=400, show_default=True)
@click.option("--engine", is_flag=True, help="Also decode over 2 ranks (TP only, PP only) each round.")
@click.option("--new", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--hog", is_flag=True, help="A busy process at nice 19 per core while it measures.")
def main(rounds, rows, hidden, calls, engine, new, hog):
    print(f"[gloo] 2 processes, 1 thread each, {rows} x {hidden} fp32, {calls} calls after 50; us"
          + (f"; {os.cpu_count()} busy processes at nice 19 beside them" if hog else ""))
    hogs = [subprocess.Popen([sys.executable, "-c", "import os; os.nice(19)\nwhile True: pass"])
            for _ in range(os.cpu_count() or 1)] if hog else []
    try:
        _rounds(rounds, rows, hidden, calls, engine, new)
    finally:
        for p in hogs:
            p.kill()


def _rounds(rounds, rows, hidden, calls, engine, new):
    for r in range(rounds):
        for name, value in SETTINGS.items():
            os.environ["PHASEFLIP_GLOO_BATCH"] = value
            for what, us in _collectives(rows, hidden, calls).items():
                print(f"round {r + 1}, {name:10s} {what:22s} {_summary(us)}", flush=True)
            if engine:
                rates = _engine(new)
                print(f"round {r + 1}, {name:10s} decode tok/s: "
                      + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()), flush=True)
    os.environ.pop("PHASEFLIP_GLOO_BATCH", None)


if __name__ == "__main__":
    main()
