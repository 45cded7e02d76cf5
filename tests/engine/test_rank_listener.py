"""The rank listener admits exactly the ranks the controller started: a connection from another
process, a rank named twice or out of range is closed; a wrong key's handshake is dropped and accepting
goes on."""
import multiprocessing as mp
import multiprocessing.connection
import os
import threading

import pytest

from phaseflip.engine.ranks.listener import Acceptor, RankListener, admit

pytestmark = pytest.mark.skipif(not hasattr(__import__("socket"), "SO_PEERCRED"),
                                reason="peer credentials (SO_PEERCRED) are Linux's: elsewhere the key alone admits")


def _connect(listener: RankListener, rank, authkey: bytes | None = None) -> threading.Thread:
    def run():
        try:
            conn = mp.connection.Client(listener.control, family="AF_UNIX", authkey=authkey or listener.authkey)
        except (mp.AuthenticationError, EOFError, OSError):
            return
        conn.send(rank)
        conn.poll(10.0)   # held open until the listener side closes it
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _next(acceptor: Acceptor):
    conn = acceptor.next(10.0)
    assert conn is not None, "no connection came"
    return conn


def test_only_started_processes_each_rank_once():
    with RankListener() as listener:
        assert oct(os.stat(os.path.dirname(listener.control)).st_mode & 0o777) == "0o700"
        acceptor = Acceptor(listener)
        try:
            connected: dict[int, object] = {}
            _connect(listener, 0)   # this very process, but not one the controller started
            assert admit(_next(acceptor), [os.getpid() + 1, os.getpid() + 2], connected, 2) is None
            _connect(listener, 0)   # started (this pid is rank 0's): admitted
            conn = _next(acceptor)
            assert admit(conn, [os.getpid(), os.getpid() + 1], connected, 2) == 0
            connected[0] = conn
            for bad in (0, 5, "1", True):   # rank 0 again, out of range, not an int
                _connect(listener, bad)
                assert admit(_next(acceptor), [os.getpid(), os.getpid()], connected, 2) is None, bad
        finally:
            acceptor.stop()


def test_a_wrong_key_is_dropped_and_accepting_goes_on():
    with RankListener() as listener:
        acceptor = Acceptor(listener)
        try:
            _connect(listener, 0, authkey=b"not the key").join(10.0)
            _connect(listener, 1)
            conn = _next(acceptor)
            assert admit(conn, [0, os.getpid()], {}, 2) == 1
        finally:
            acceptor.stop()
    assert not os.path.exists(os.path.dirname(listener.control)), "the socket's directory stayed"
