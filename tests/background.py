"""Subprocess jobs the suite starts at its beginning and collects where a test needs them.

Owns `Job`, `run_in_order` and the jobs whose work is a process of its own: HF's greedy reference of
SmolLM2, the Triton kernels' self-check (through Triton's interpreter on the CPU) and the GPU check's
dry run. Run in turn they cost the suite ~80 s on 2 cores while it keeps one core busy most of the
time; run one after the other beside the suite, in the order its tests need them, at the lowest
priority (nice 19), they take the core the suite leaves idle and give it back whenever the suite's own
threads want it. A test that needs a job not yet started starts it at once. A job is made only when a
test of the session uses its fixture; one still running when the session ends is killed.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_STARTED: list[subprocess.Popen] = []   # every job's process, for `pids`


@dataclass(frozen=True)
class Finished:
    returncode: int
    stdout: str
    stderr: str


class Job:
    """One subprocess at nice 19, started by `start` (once: later calls do nothing), its output in
    temporary files (a pipe could fill while nobody reads); `out_dir`: where it writes its files."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, out_dir: Path | None = None):
        self.argv, self.out_dir = argv, out_dir
        self._env = dict(os.environ if env is None else env)
        self._env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), self._env.get("PYTHONPATH")]))
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._killed = False
        self._finished: Finished | None = None

    def start(self) -> None:
        with self._lock:
            if self._proc is None and not self._killed:
                self._proc = subprocess.Popen(self.argv, cwd=ROOT, env=self._env, stdout=self._out,
                                              stderr=self._err, stdin=subprocess.DEVNULL,
                                              preexec_fn=lambda: os.nice(19))
                _STARTED.append(self._proc)

    def wait(self) -> None:
        """Until the job's process has ended (at once when it was never started)."""
        if self._proc is not None:
            self._proc.wait()

    def result(self, timeout_s: float) -> Finished:
        """Starts the job if it has not started, waits for it (at most timeout_s from now) and returns
        what it wrote."""
        if self._finished is None:
            self.start()
            try:
                code = self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
            self._finished = Finished(code, self._read(self._out), self._read(self._err))
        return self._finished

    def kill(self) -> None:
        with self._lock:
            self._killed = True
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()

    @staticmethod
    def _read(f) -> str:
        f.seek(0)
        return f.read().decode(errors="replace")


def pids() -> set[int]:
    """The live processes of the jobs and everything they started: a test that counts this process's
    children (the ones its engine started) leaves these out."""
    import psutil
    found = set()
    for proc in _STARTED:
        try:
            top = psutil.Process(proc.pid)
            found |= {top.pid} | {p.pid for p in top.children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    return found


def run_in_order(jobs: list[Job]) -> None:
    """Starts each job when the one before it has ended, on a daemon thread."""
    def run():
        for job in jobs:
            job.start()
            job.wait()
    threading.Thread(target=run, name="suite-background-jobs", daemon=True).start()


def python(*args: str, env: dict[str, str] | None = None, out_dir: Path | None = None) -> Job:
    return Job([sys.executable, *args], env, out_dir)


def kernel_selfcheck(names: list[str]) -> Job:
    """phaseflip/kernels/selfcheck.py's cases; TRITON_INTERPRET set in that process only, without CUDA
    (it must be set before triton is first imported)."""
    import torch
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    return python("-m", "phaseflip.kernels.selfcheck", *names, env=env)


def gpu_check_dry_run(out_dir: Path) -> Job:
    """Its time budget (300 s in a dry run) is wall time: here the job may be starved for minutes by
    the suite's own threads, so it gets 900."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)   # the script sets it itself in a dry run
    return python("-m", "phaseflip.tools.gpu_check", "--dry-run", "--budget-s", "900", "--out", str(out_dir),
                  env=env, out_dir=out_dir)


def hf_reference(model_dir: Path, new_tokens: int) -> Job:
    return python("-m", "tests.hf_reference", str(model_dir), str(new_tokens))
