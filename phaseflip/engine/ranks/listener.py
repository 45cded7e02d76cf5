"""The listener that rank processes connect back to, and the admission of exactly the ranks started.

Owns: `RankListener`: a multiprocessing Listener with a fresh key, on a Unix socket in a private
directory (mkdtemp: mode 0700) where the platform reports a peer's credentials (Linux), else on
127.0.0.1. The key reaches the ranks in their environment (`secrets`), never on a command line.
`Acceptor` accepts in a thread (Listener.accept takes no timeout); a connection that fails the key's
handshake is logged and dropped, and accepting goes on. `admit` serves a connection only when its
peer is a process the controller started (by pid, where the socket says it) and it names a rank not
yet connected; anything else is closed and logged. `remove_open_dirs`: the directories of listeners still
open, removed by a process that ends without unwinding while a boot is under way.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import shutil
import socket
import struct
import tempfile
import threading

from phaseflip.engine.ranks.process import AUTHKEY_ENV

log = logging.getLogger("phaseflip")

NAME_WAIT_S = 5.0   # how long a connection that passed the handshake has to name its rank
_OPEN_DIRS: set[str] = set()   # the socket directories of the listeners not yet closed


class RankListener:
    def __init__(self):
        self.authkey = os.urandom(16)
        self._dir: str | None = None
        if hasattr(socket, "SO_PEERCRED"):
            self._dir = tempfile.mkdtemp(prefix="phaseflip-ranks-")
            _OPEN_DIRS.add(self._dir)
            self.listener = mp.connection.Listener(os.path.join(self._dir, "control"), "AF_UNIX",
                                                   authkey=self.authkey)
            self.control = self.listener.address
        else:
            self.listener = mp.connection.Listener(("127.0.0.1", 0), authkey=self.authkey)
            host, port = self.listener.address
            self.control = f"{host}:{port}"

    @property
    def secrets(self) -> dict[str, str]:
        """What a rank's environment carries to connect back."""
        return {AUTHKEY_ENV: self.authkey.hex()}

    def close(self) -> None:
        self.listener.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            _OPEN_DIRS.discard(self._dir)

    def __enter__(self) -> "RankListener":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def remove_open_dirs() -> None:
    """For a process about to end by os._exit while a boot is under way: its listener's directory would
    outlive it in the temp dir."""
    for path in list(_OPEN_DIRS):
        shutil.rmtree(path, ignore_errors=True)
        _OPEN_DIRS.discard(path)


def peer_pid(conn) -> int | None:
    """The pid of the process at the other end of a Unix-socket connection; None where unknown."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as s:
            if s.family != socket.AF_UNIX:
                return None
            pid, _, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except OSError:
        return None
    return pid


def admit(conn, pids: list[int], connected: dict[int, object], world_size: int) -> int | None:
    """The rank this connection serves, or None (the connection closed) when its peer is not a process
    the controller started, or it names no rank, an unknown one or one already connected."""
    pid = peer_pid(conn)
    rank = None
    if pid is None or pid in pids:
        try:
            rank = conn.recv() if conn.poll(NAME_WAIT_S) else None
        except (EOFError, OSError):
            rank = None
    known = isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < world_size
    if known and rank not in connected and (pid is None or pid == pids[rank]):
        return rank
    log.warning("refused a connection to the rank listener (peer pid %s, named rank %r; started ranks: %s)",
                pid, rank, pids)
    conn.close()
    return None


class Acceptor:
    """Accepts connections on `listener` in a daemon thread and hands them over one at a time, so the
    caller can wait with a timeout. A failed handshake (a wrong key, a peer that hung up) is logged and
    accepting goes on."""

    def __init__(self, listener: RankListener):
        self.listener = listener
        self.accepted: queue.Queue = queue.Queue()   # connections, or the exception that ended accepting
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="phaseflip-accept", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                conn = self.listener.listener.accept()
            except (mp.AuthenticationError, EOFError, ConnectionError) as e:
                if not self.stopping.is_set():
                    log.warning("the rank listener dropped a connection that failed its handshake: %r", e)
                continue
            except Exception as e:  # noqa: BLE001 — raised by next() in the caller's thread
                if not self.stopping.is_set():
                    self.accepted.put(e)
                return
            if self.stopping.is_set():
                conn.close()
                return
            self.accepted.put(conn)

    def next(self, timeout_s: float):
        """The next accepted connection, or None when none came within timeout_s."""
        try:
            got = self.accepted.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if isinstance(got, Exception):
            raise got
        return got

    def stop(self) -> None:
        """End the thread: a connection of our own wakes an accept still waiting (its handshake fails)."""
        self.stopping.set()
        if self.thread.is_alive():
            address = self.listener.listener.address
            family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
            try:
                with socket.socket(family) as s:
                    s.settimeout(1.0)
                    s.connect(address)
            except OSError:
                pass
            self.thread.join(1.0)
