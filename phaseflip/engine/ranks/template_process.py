"""The rank template's own process: imports what a rank imports once, then forks a rank per request.

Owns: `serve` (the process's loop: `python -m phaseflip.engine.ranks.template_process CONTROLLER_PID
PDEATHSIG FD IDLE_S`, started by template.py, which owns the controller's end and says why the template
exists) and what makes a forked rank what a fresh one would be (`_fork`: a session of its own, the
controller's stdio, environment and working directory of the moment, numpy reseeded, the file-backed
pages the template had mapped mapped again). It reports each rank's start and exit to the controller on
its socket, exits when the controller's end closes, and leaves on its own after IDLE_S seconds with no
live rank.
"""
from __future__ import annotations

import ctypes
import os
import pickle
import select
import signal
import socket
import sys
import time
import warnings


def serve(controller_pid: int, pdeathsig: bool, fd: int, idle_limit_s: float) -> None:
    """Import what a rank imports, then fork a rank per request until the controller goes away."""
    import phaseflip.engine.ranks.process as rank_process   # the import each fresh rank would pay
    rank_process.die_with_parent(controller_pid, pdeathsig)   # as a rank does with its parent
    # Python 3.12+ warns at a fork with other threads (here the watchdog's, OpenBLAS's); neither holds
    # anything a forked rank needs
    warnings.filterwarnings("ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning)
    resident = _resident_file_pages()
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    for end in (wake_r, wake_w):
        os.set_blocking(end, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)   # a child's exit wakes the select below
    live: set[int] = set()
    idle_since = time.monotonic()
    while live or time.monotonic() - idle_since < idle_limit_s:
        ready, _, _ = select.select([sock, wake_r], [], [], 1.0)
        if wake_r in ready:
            while _drained(wake_r):
                pass
        if sock in ready:
            try:
                data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
            except OSError:
                break
            if not data:
                break
            pid = _fork(rank_process, *pickle.loads(data), fds, (sock.fileno(), wake_r, wake_w), resident)
            for passed in fds:
                os.close(passed)
            if pid:
                live.add(pid)
            sock.send(pickle.dumps(("started", pid, None) if pid else ("failed", 0, None)))
        if _reap(live, sock) and not live:
            idle_since = time.monotonic()
    os._exit(0)   # the ranks still running die with this process (their PR_SET_PDEATHSIG)


def _drained(fd: int) -> bool:
    try:
        return bool(os.read(fd, 512))
    except BlockingIOError:
        return False


def _reap(live: set[int], sock) -> bool:
    """Report every child that exited; True when any did."""
    reaped = False
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        live.discard(pid)
        reaped = True
        try:
            sock.send(pickle.dumps(("exited", pid, os.waitstatus_to_exitcode(status))))
        except OSError:
            pass


def _fork(rank_process, args: list[str], env: dict, cwd: str, fd_targets: list[int], fds: list[int],
          own_fds: tuple, resident: list[tuple[int, int]] = ()) -> int:
    """Fork one rank; in the child, become what a fresh `python -m phaseflip.engine.ranks.process` is."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError:
        return 0
    if pid:
        return pid
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        for target, passed in zip(fd_targets, fds):
            os.dup2(passed, target)
        for fd in (*fds, *own_fds):
            os.close(fd)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        _reseed()
        _map(resident)
        sys.argv = [rank_process.__file__, *args]
        rank_process.main(int(args[0]), int(args[1]), args[2], args[3], os.getppid(), True)
    except BaseException:   # noqa: BLE001 — a fresh interpreter would print it and exit 1
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def _resident_file_pages() -> list[tuple[int, int]]:
    """(address, bytes) runs of the file-backed pages (the libraries' code and constants) this process
    has mapped. fork copies no page-table entries for them: without _map, a forked rank's RSS starts
    ~70 MB short of a fresh rank's and grows as it runs the code, which its memory ledger (RSS at start
    as the framework's overhead) would report as unexplained."""
    import numpy as np
    page, runs = os.sysconf("SC_PAGE_SIZE"), []
    try:
        with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pagemap:
            for line in maps:
                fields = line.split()
                if len(fields) < 6 or not fields[5].startswith("/") or not fields[1].startswith("r"):
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                pagemap.seek(start // page * 8)
                present = np.frombuffer(pagemap.read((end - start) // page * 8), dtype=np.uint64) >> np.uint64(63)
                edges = np.flatnonzero(np.diff(np.concatenate(([0], present.astype(np.int8), [0]))))
                runs += [(start + a * page, (b - a) * page) for a, b in zip(edges[::2].tolist(), edges[1::2].tolist())]
    except OSError:
        return []   # no /proc to read: a forked rank maps the pages as it uses them
    return runs


def _map(runs: list[tuple[int, int]]) -> None:
    """Map `runs` into this process's page tables from the page cache (MADV_POPULATE_READ, Linux 5.14;
    where it fails the pages map as they are used)."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    for address, length in runs:
        madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), 22)


def _reseed() -> None:
    if "numpy.random" in sys.modules:   # seeded from the OS when imported: once, in the template
        sys.modules["numpy.random"].seed()


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3]), float(sys.argv[4]))
