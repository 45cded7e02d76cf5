"""The rank template: a process that has already imported a rank's code and forks rank processes.

Owns: `start_rank` (a CPU rank process for ProcessRanks, as a handle shaped like subprocess.Popen's:
pid, poll, wait, kill, terminate, returncode) and the controller's end of the template process
(template_process.py: `python -m phaseflip.engine.ranks.template_process CONTROLLER_PID PDEATHSIG FD IDLE_S`),
what travels between them.

Why: a rank started as a fresh interpreter spends seconds of its start importing torch, every boot. A
process that boots more than one multi-rank engine (a notebook, an evaluation sweep, the test suite's
~55 boots) pays that once: the template imports a rank's modules when its first rank is asked for,
then forks each rank from that state (a fork takes milliseconds). The first boot takes as long as
without the template: fresh ranks import in parallel, the template imports once.

A forked rank is what a fresh one would be: a session of its own; the controller's stdin, stdout and
stderr of the moment (sent with each request); the controller's environment and working directory of
the moment; numpy's global generator reseeded (Python's `random` reseeds itself in a forked child;
torch's default generator is, as in a fresh process, at its default seed); its exit status reported to the
controller through the template. It dies with the controller: the template dies with it
(as a rank does: PR_SET_PDEATHSIG when started from the controller's main thread, and a watch on its
parent; also the end of its socket) and every rank dies with the template (PR_SET_PDEATHSIG). The template
exits on its own once it has had no live rank for IDLE_S seconds (PHASEFLIP_RANK_TEMPLATE_IDLE_S, read
when a template starts; a few seconds by default, so no process of the engine outlives its shutdown by
more; a notebook or a sweep that boots engines back to back may keep it longer).

A new template replaces the one that was started under another working directory or another value of
a variable that a library may read when it is imported (IMPORT_TIME_ENV), or that failed to start a
rank; the old one is closed at once when idle, else when its ranks are gone and its idle time has passed.
A fresh interpreter starts the rank instead (as without the template): on CUDA (a forked process must
not inherit a CUDA driver state), with PHASEFLIP_RANK_TEMPLATE=0, and for a rank the template failed
to start.
"""
from __future__ import annotations

import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading

IDLE_S = 3.0   # seconds a template with no live rank lives on, unless PHASEFLIP_RANK_TEMPLATE_IDLE_S says
IDLE_ENV = "PHASEFLIP_RANK_TEMPLATE_IDLE_S"
# Variables a library or the interpreter may read when the template imports torch (OpenMP, BLAS,
# allocators, torch's own): a template started under other values would give its ranks stale ones.
# The rest (PHASEFLIP_*, a test runner's own) is read at run time: a rank gets the controller's values.
IMPORT_TIME_ENV = ("PYTHON", "LD_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "DNNL_", "ONEDNN_",
                   "TORCH", "PYTORCH_", "ATEN_", "CUDA", "NCCL_", "GLOO_", "TRITON_", "MALLOC_", "TMP",
                   "TEMP", "HOME", "PATH", "XDG_")
MODULE = "phaseflip.engine.ranks.template_process"
RANK_MODULE = "phaseflip.engine.ranks.process"

_lock = threading.Lock()
_template: "_Template | None" = None


def start_rank(args: list[str], device: str, on_main_thread: bool, secrets: dict[str, str]):
    """Rank process `args` (process.main's first four arguments, as strings) with `secrets` added to
    its environment (never to its command line: /proc/PID/cmdline is readable by every user, environ by
    the same user only), forked by this process's template on the CPU, else a fresh interpreter."""
    mode = os.environ.get("PHASEFLIP_RANK_TEMPLATE", "1")
    if mode not in ("0", "1"):
        raise ValueError(f"PHASEFLIP_RANK_TEMPLATE={mode!r}: expected 1 (fork CPU ranks from a template "
                         "process) or 0 (start each rank as a fresh interpreter)")
    if device == "cpu" and mode == "1":
        template = _usable_template(on_main_thread)
        if template is not None:
            handle = template.launch(args, secrets)
            if handle is not None:
                return handle
    return subprocess.Popen([sys.executable, "-m", RANK_MODULE, *args, str(os.getpid()), str(int(on_main_thread))],
                            env={**os.environ, **secrets}, start_new_session=True)


def idle_s() -> float:
    """PHASEFLIP_RANK_TEMPLATE_IDLE_S as seconds >= 0, else IDLE_S; a bad value is named."""
    text = os.environ.get(IDLE_ENV)
    if text is None:
        return IDLE_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{IDLE_ENV}={text!r}: expected the seconds (a number >= 0) a rank template with no "
                         "rank lives on")
    return value


def _import_time_env(env) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


def _usable_template(on_main_thread: bool) -> "_Template | None":
    global _template
    with _lock:
        t = _template if _template is not None and _template.owner == os.getpid() else None  # not a fork's
        if t is not None and t.alive() and t.env == _import_time_env(os.environ) and t.cwd == os.getcwd():
            return t
        if t is not None and not t.live_ranks():
            t.close()   # else it serves its ranks to the end and leaves once idle long enough
        _template = _Template(on_main_thread)
        return _template


class RankHandle:
    """A rank forked by the template, handled like a subprocess.Popen (the template reports its exit)."""

    def __init__(self, template: "_Template", pid: int, args: list[str]):
        self.template, self.pid, self.args = template, pid, args

    @property
    def returncode(self) -> int | None:
        return self.template.codes.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.template.cond:
            if not self.template.cond.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:   # reported exits are reaped: their pid may belong to another process
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Template:
    """The controller's end: the template process, its socket and the exits it reported."""

    def __init__(self, on_main_thread: bool):
        idle = idle_s()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env, self.cwd, self.owner = _import_time_env(os.environ), os.getcwd(), os.getpid()
        self.proc = subprocess.Popen([sys.executable, "-m", MODULE, str(os.getpid()), str(int(on_main_thread)),
                                      str(theirs.fileno()), str(idle)], pass_fds=[theirs.fileno()],
                                     start_new_session=True)
        theirs.close()
        self.sock = ours
        self.codes: dict[int, int | None] = {}   # pid -> exit code (None while it runs)
        self.cond = threading.Condition()
        self.replies: queue.Queue = queue.Queue()
        self.launching = threading.Lock()
        self.dead = False     # the template process has exited
        self.usable = True    # False after a launch it failed: its ranks still run, no new ones start there
        threading.Thread(target=self._read, name="phaseflip-rank-template", daemon=True).start()

    def alive(self) -> bool:
        return not self.dead and self.usable

    def live_ranks(self) -> list[int]:
        with self.cond:
            return [pid for pid, code in self.codes.items() if code is None]

    def launch(self, args: list[str], secrets: dict[str, str], timeout_s: float = 60.0) -> RankHandle | None:
        """A rank forked with these args and `secrets` in its environment, or None when the template
        could not (no rank starts there after that; it is closed once its ranks are gone: closing it
        would take them along)."""
        fds = [fd for fd in (0, 1, 2) if _is_open(fd)]
        request = pickle.dumps((args, {**os.environ, **secrets}, os.getcwd(), fds))
        with self.launching:
            try:
                socket.send_fds(self.sock, [request], fds)
                pid = self.replies.get(timeout=timeout_s)   # the first waits for the template's imports
            except (OSError, queue.Empty):
                pid = None
        if pid is None:
            self.usable = False
            if not self.live_ranks():
                self.close()
            return None
        return RankHandle(self, pid, [MODULE, *args])

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            kind, pid, code = pickle.loads(data)
            if kind == "failed":
                self.replies.put(None)
                continue
            with self.cond:
                self.codes[pid] = code   # "started" (None) always comes before its "exited"
                self.cond.notify_all()
            if kind == "started":
                self.replies.put(pid)
        with self.cond:   # the template is gone, and its ranks with it (their PR_SET_PDEATHSIG)
            self.dead = True
            for pid, code in self.codes.items():
                if code is None:
                    self.codes[pid] = -signal.SIGKILL
            self.cond.notify_all()
        self.replies.put(None)
        self.proc.wait()

    def close(self) -> None:
        self.dead = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)   # the template reads the end and exits
        except OSError:
            pass


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False
