"""Subprocess jobs the suite starts at its beginning and collects where a test needs them.

Owns `Job` and the jobs whose work is a process of its own: the Triton kernels' self-check (through
Triton's interpreter on the CPU), the GPU check's dry run and HF's greedy reference of SmolLM2. Run in
turn they cost the suite ~80 s on 2 cores while it keeps one core busy most of the time; started at the
session's start at the lowest priority (nice 19), they take the core the suite leaves idle and give it
back whenever the suite's own threads want it. A job is started only when a test of the session uses
its fixture, and one still running when the session ends is killed.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Finished:
    returncode: int
    stdout: str
    stderr: str


class Job:
    """One subprocess at nice 19, its output in temporary files (a pipe could fill while nobody reads);
    `out_dir`: where it writes its files, if it does."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, out_dir: Path | None = None):
        self.argv, self.out_dir = argv, out_dir
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self._proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self._out, stderr=self._err,
                                      stdin=subprocess.DEVNULL, preexec_fn=lambda: os.nice(19))
        self._finished: Finished | None = None

    def result(self, timeout_s: float) -> Finished:
        """Waits for the job (at most timeout_s from now) and returns what it wrote."""
        if self._finished is None:
            try:
                code = self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
            self._finished = Finished(code, self._read(self._out), self._read(self._err))
        return self._finished

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    @staticmethod
    def _read(f) -> str:
        f.seek(0)
        return f.read().decode(errors="replace")


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
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)   # the script sets it itself in a dry run
    return python("-m", "phaseflip.tools.gpu_check", "--dry-run", "--out", str(out_dir), env=env, out_dir=out_dir)


def hf_reference(model_dir: Path, new_tokens: int) -> Job:
    return python("-m", "tests.hf_reference", str(model_dir), str(new_tokens))
