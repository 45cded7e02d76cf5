"""Subprocess jobs the suite starts at its beginning and collects where a test needs them.

Owns `Job`, `run_in_order` and the registry of jobs (`register`, `start`): work whose time is a process
of its own (HF's greedy reference of SmolLM2, the Triton kernels' self-check through Triton's
interpreter, the GPU check's dry run, boots under torchrun, `phaseflip bench`, a child pytest...). Run in
turn they cost the suite minutes on 2 cores while it keeps about one core busy; run one after the other
beside the suite, in the order its tests need them, at the lowest priority (nice 19), they take the core
the suite leaves idle and give it back whenever the suite's own threads want it. A test that needs a job
not yet started starts it at once. Each job is registered under the name of the fixture that collects it,
beside its test (a module or conftest imported at collection); it is made only when a test of the session
uses that fixture, and one still running when the session ends is killed.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

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

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, out_dir: Path | None = None,
                 sigint_ignored: bool = False):
        self.argv, self.out_dir, self.sigint_ignored = argv, out_dir, sigint_ignored
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
                                              preexec_fn=self._lowest_priority)
                _STARTED.append(self._proc)

    def _lowest_priority(self) -> None:
        os.nice(19)
        if self.sigint_ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

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

    def stdout(self, what: str, timeout_s: float = 600) -> str:
        """What the job wrote to stdout, once it has ended with 0 (`result`'s wait); a failure names `what`,
        the exit code and the end of stderr."""
        done = self.result(timeout_s)
        assert done.returncode == 0, f"{what} failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
        return done.stdout

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


def python(*args: str, env: dict[str, str] | None = None, out_dir: Path | None = None,
           sigint_ignored: bool = False) -> Job:
    return Job([sys.executable, *args], env, out_dir, sigint_ignored)


@dataclass(frozen=True)
class Session:
    """What a job's maker may use: the session's selected tests, its fixtures, its temp dirs."""
    items: list
    fixture: Callable[[str], Any]        # request.getfixturevalue of a session-scoped fixture
    mktemp: Callable[[str], Path]        # tmp_path_factory.mktemp


Maker = Callable[[Session], "Job | tuple[Job, ...] | None"]
_MAKERS: dict[str, Maker] = {}


def register(fixture_name: str) -> Callable[[Maker], Maker]:
    """Decorator: `maker(session)` makes the job(s) that the fixture `fixture_name` collects (None: none
    can run here; that fixture then says why)."""
    def add(maker: Maker) -> Maker:
        assert fixture_name not in _MAKERS, f"two jobs for fixture {fixture_name!r}"
        _MAKERS[fixture_name] = maker
        return maker
    return add


def start(session: Session) -> dict[str, Job | tuple[Job, ...]]:
    """fixture name -> its job(s), for each registered fixture a selected test uses, run one after the
    other in the order of the first test that uses each."""
    first: dict[str, int] = {}
    for index, item in enumerate(session.items):
        for name in item.fixturenames:
            first.setdefault(name, index)
    jobs = {}
    for name in sorted(first.keys() & _MAKERS.keys(), key=first.get):
        made = _MAKERS[name](session)
        if made is not None:
            jobs[name] = made
    run_in_order([job for made in jobs.values() for job in (made if isinstance(made, tuple) else (made,))])
    return jobs


def kill(jobs: dict[str, Job | tuple[Job, ...]]) -> None:
    for made in jobs.values():
        for job in made if isinstance(made, tuple) else (made,):
            job.kill()
