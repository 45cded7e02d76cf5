"""Rank processes: spawning them, sending commands, collecting replies, propagating failures.

Owns: the controller's side of the rank group. `LocalRanks` runs the single rank in-process (world
size 1); `ProcessRanks` spawns world_size processes (engine/ranks/process.py) that form a
torch.distributed group (gloo on CPU, NCCL on CUDA); under torchrun, engine/ranks/torchrun.py.
A rank's exception reaches the caller as RankError naming the rank with its traceback;
a dead rank raises EngineDeadError naming it (polled every 0.1 s: never a hang); ranks exit when the
controller dies (PR_SET_PDEATHSIG plus a parent watchdog); shutdown() leaves no process behind.
A Ctrl-C never leaves the ranks out of step: it is held back while a command is sent or a reply read,
and a call interrupted by any exception (a Ctrl-C, a signal handler's) still collects its replies,
within DRAIN_S; when it cannot (a second interrupt, a silent rank, another handler's exception that
cut a send or a reply read mid-way), the engine is declared dead with the reason, so that no later
call reads a stale reply.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import threading
import time
from contextlib import contextmanager

from phaseflip.engine.ranks.listener import Acceptor, RankListener, admit
from phaseflip.engine.ranks.progress import BootProgress
from phaseflip.engine.ranks.process import load_checkpoint
from phaseflip.engine.ranks.template import start_rank
from phaseflip.rank.comm import NoComm
from phaseflip.rank.messages import FlipCommand, RankBoot, RankFailure, RankProgress, Shutdown
from phaseflip.rank.runtime import RankRuntime
from phaseflip.rank.worker import failure, handle


# Seconds the surviving ranks of a failed or dead one get to exit before they are killed: they may be
# stuck in a collective with it, which only the kill (or a 600 s collective timeout) would end.
DEAD_GRACE_S = 2.0
# Seconds an interrupted call waits for the replies to the command it sent (a flip or a long prefill
# step may be under way) before it gives the ranks up as out of step.
DRAIN_S = 60.0


class RankError(RuntimeError):
    def __init__(self, rank: int, error: str, tb: str):
        super().__init__(f"rank {rank} failed: {error}\n--- rank {rank} traceback ---\n{tb}")
        self.rank, self.error, self.rank_traceback = rank, error, tb


class EngineDeadError(RuntimeError):
    """The engine cannot serve any more (a rank died or failed mid-step); create a new LLM."""


class LocalRanks:
    """World size 1: the rank runtime lives in the controller's process. A failed command leaves
    nothing behind that the next one depends on (the step's sequences are aborted, a flip rolls
    back), so the engine goes on serving after a RankError. A Ctrl-C waits for a flip to finish or
    roll back: half a flip (weights refilled, layout not switched) would break every later step."""
    world_size = 1

    def __init__(self, boot: RankBoot):
        try:
            with BootProgress(boot, 1) as bar:
                self.runtime = RankRuntime(boot, 0, NoComm(), load_checkpoint, bar.update_from(0))
        except Exception as e:  # noqa: BLE001 — the same shape as a rank process's boot failure
            raise RankError(0, f"{type(e).__name__}: {e}", failure(0, e).traceback) from e
        self.ready = [self.runtime.ready()]
        self.pids = [os.getpid()]
        self.dead = None

    def call(self, msg) -> list:
        try:
            if isinstance(msg, FlipCommand):
                with _interrupts_deferred():
                    return [handle(self.runtime, msg)]
            return [handle(self.runtime, msg)]
        except Exception as e:  # noqa: BLE001 — same shape as a remote rank's failure
            raise RankError(0, f"{type(e).__name__}: {e}", failure(0, e).traceback) from e

    def shutdown(self) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessRanks:
    """Rank processes (not multiprocessing's, which re-imports the user's __main__ module): on the CPU
    forked by this process's rank template (engine/ranks/template.py), else fresh interpreters; each
    connects back to a local listener with an auth key."""

    def __init__(self, boot: RankBoot, world_size: int, poll_s: float = 0.1):
        self.world_size, self.poll_s = world_size, poll_s
        self.dead: str | None = None
        self.torn: int | None = None  # a rank whose reply an exception may have cut mid-read
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        with RankListener() as listener:
            # A session of their own: a Ctrl-C at the terminal interrupts the controller (which keeps
            # the ranks in lockstep), not the ranks. They still die with the controller (PDEATHSIG).
            self.procs = [start_rank([str(rank), str(world_size), init_method, listener.control],
                                     boot.device, _on_main_thread(), listener.secrets)
                          for rank in range(world_size)]
            self.pids = [p.pid for p in self.procs]
            self.conns = self._accept(listener)
        for conn in self.conns:
            conn.send(boot)
        try:
            with BootProgress(boot, world_size) as bar:
                self.ready = self._collect(progress=bar)
        except BaseException:
            self.shutdown()
            raise

    def _accept(self, listener: RankListener, timeout_s: float = 60.0) -> list:
        """Each rank connects back and names itself (listener.admit: only the processes started here,
        each rank once); one that dies first is noticed within poll_s."""
        conns: dict[int, object] = {}
        acceptor = Acceptor(listener)
        end = time.monotonic() + timeout_s
        try:
            while len(conns) < self.world_size:
                dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
                if dead or time.monotonic() > end:
                    reason = self._death(dead[0]) if dead else f"rank processes did not connect in {timeout_s:.0f} s"
                    self.shutdown_procs(0.0)  # the others wait for a boot that will never come
                    raise EngineDeadError(f"engine is dead: {reason}")
                conn = acceptor.next(self.poll_s)
                rank = None if conn is None else admit(conn, self.pids, conns, self.world_size)
                if rank is not None:
                    conns[rank] = conn
        finally:
            acceptor.stop()
        return [conns[r] for r in range(self.world_size)]

    def _collect(self, replies: dict | None = None, progress=None, until: float | None = None) -> list:
        """One reply per rank (or those in by time.monotonic() `until`). The first RankFailure wins at
        once (its peers may be stuck in a collective with it); a dead process is noticed within poll_s.
        RankProgress messages (boot) go to `progress`."""
        replies = {} if replies is None else replies
        while len(replies) < self.world_size and (until is None or time.monotonic() < until):
            pending = {self.conns[r]: r for r in range(self.world_size) if r not in replies}
            for conn in mp.connection.wait(list(pending), timeout=self.poll_s):
                rank = pending[conn]
                try:
                    # a Ctrl-C inside recv would lose a reply read half or whole but not yet stored
                    with _interrupts_deferred():
                        replies[rank] = conn.recv()
                except (EOFError, OSError):
                    self._die(self._death(rank))
                except BaseException:  # another signal's exception (not held back): maybe mid-read
                    if rank not in replies:
                        self.torn = rank
                    raise
                reply = replies[rank]
                if isinstance(reply, RankProgress):
                    del replies[rank]
                    if progress is not None:
                        progress.update(reply)
                    continue
                if isinstance(reply, RankFailure):
                    self._fail(reply)
            for r, p in enumerate(self.procs):  # an exited rank's last words are read first
                if r not in replies and p.poll() is not None and not self.conns[r].poll():
                    self._die(self._death(r))
        return [replies.get(r) for r in range(self.world_size)]

    def _fail(self, reply: RankFailure, echo_s: float = 0.25):
        """A rank raised. When a peer crashed, the failure is usually its echo (a collective with it
        broke): the crash is the cause to report, so crashing peers get echo_s to show up first. (A
        rank that exits 0 does so on purpose, after reporting its own failure.)"""
        end = time.monotonic() + echo_s
        while time.monotonic() < end:
            dead = [r for r, p in enumerate(self.procs) if p.poll() not in (None, 0)]
            if dead:
                self._die(self._death(dead[0]))
            time.sleep(0.02)
        self.dead = f"rank {reply.rank} failed: {reply.error}"
        self.shutdown(DEAD_GRACE_S)
        raise RankError(reply.rank, reply.error, reply.traceback)

    def _death(self, rank: int) -> str:
        p = self.procs[rank]
        try:
            code = p.wait(1.0)
        except subprocess.TimeoutExpired:
            return f"rank {rank} (pid {p.pid}) closed its channel and is still running"
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return f"rank {rank} (pid {p.pid}) died ({how})"

    def _die(self, reason: str):
        self.dead = reason
        self.shutdown(DEAD_GRACE_S)
        raise EngineDeadError(f"engine is dead: {reason}")

    def call(self, msg) -> list:
        if self.dead:
            raise EngineDeadError(f"engine is dead: {self.dead}")
        replies: dict[int, object] = {}
        started = sent = 0  # ranks whose send began, and ended
        try:
            with _interrupts_deferred():  # a Ctrl-C: every rank gets the command, or none does
                for rank, conn in enumerate(self.conns):
                    started += 1
                    try:
                        conn.send(msg)
                    except OSError:
                        self._die(self._death(rank))
                    sent += 1
            return self._collect(replies)
        except BaseException as e:
            if not self.dead and started:
                self._keep_in_step(e, sent, replies)
            raise

    def _keep_in_step(self, cause: BaseException, sent: int, replies: dict) -> None:
        """After `cause` cut a call short: when every rank got the command whole, drain its replies;
        when a send or a reply read may have been cut mid-way (a Ctrl-C is held back there; another
        signal handler's exception is not), the ranks and the controller cannot agree any more: the
        engine is dead, and the reason says why."""
        if sent == self.world_size and self.torn is None:
            self._drain(replies, cause)
            return
        what = (f"reading rank {self.torn}'s reply" if self.torn is not None
                else f"sending a command ({sent} of {self.world_size} ranks got it whole)")
        self.dead = f"{_name(cause)} interrupted {what}: ranks out of step"
        self.shutdown(DEAD_GRACE_S)

    def _drain(self, replies: dict, cause: BaseException) -> None:
        """`cause` (a Ctrl-C, or any exception a signal handler raised) interrupted a call whose command
        every rank got: collect the outstanding replies, for at most DRAIN_S, so that the next call
        does not read them; when that fails, the engine is dead, and the reason names what happened."""
        try:
            self._collect(replies, until=time.monotonic() + DRAIN_S)
        except BaseException as again:  # noqa: BLE001 — the engine's death, reported by the next call
            twice = isinstance(cause, KeyboardInterrupt) and isinstance(again, KeyboardInterrupt)
            self.dead = self.dead or (
                "interrupted twice while collecting a command's replies" if twice else
                f"{_name(cause)} interrupted a call to the ranks, then {_name(again)} interrupted "
                "collecting its replies") + ": ranks out of step"
        if len(replies) < self.world_size and not self.dead:
            self.dead = (f"{_name(cause)} interrupted a call to the ranks and {self.world_size - len(replies)} "
                         f"of its replies did not come within {DRAIN_S:.0f} s: ranks out of step")
        if self.dead:
            self.shutdown(DEAD_GRACE_S)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        for conn, p in zip(self.conns, self.procs):
            if p.poll() is None:
                try:
                    conn.send(Shutdown())
                except Exception:  # noqa: BLE001 — best effort (even at interpreter exit): waited and killed below
                    pass
        self.shutdown_procs(timeout_s)
        for conn in self.conns:
            conn.close()

    def shutdown_procs(self, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(1.0)


def _name(exc: BaseException) -> str:
    return f"{type(exc).__name__}({exc})" if str(exc) else type(exc).__name__


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def _interrupts_deferred():
    """Hold a SIGINT that arrives inside the block and raise it as KeyboardInterrupt at its end."""
    if not _on_main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        if callable(previous):
            previous(signal.SIGINT, caught[0])
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt
