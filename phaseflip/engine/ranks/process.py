"""A rank's own side of the rank group: how a rank starts, and the process that ProcessRanks spawns.

Owns: what every rank does to start, wherever it runs (load_checkpoint, set_threads, comm_device:
shared with LocalRanks and the torchrun ranks), and the entry point of a spawned rank process,
`python -m phaseflip.engine.ranks.process RANK WORLD_SIZE INIT_METHOD CONTROL PARENT_PID PDEATHSIG`
(CONTROL: the listener's socket path, or HOST:PORT where the platform has no peer credentials): it
connects back to the controller's listener with the key in $PHASEFLIP_RANK_AUTHKEY (hex; the
environment, which only the same user can read, never the command line, which every user can), joins the process group and serves commands until
Shutdown. It dies with the controller (PR_SET_PDEATHSIG plus a parent watchdog) and never outlives it.
It must never import the controller's side (engine/ranks/group.py): a rank's failures travel to the
controller as RankFailure replies, not as exceptions.
"""
from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import threading
import time

import torch

from phaseflip.engine.checkpoint.loader import load_model_config, load_weights
from phaseflip.rank.comm import RankComm, init_group
from phaseflip.rank.messages import RankBoot
from phaseflip.rank.runtime import RankRuntime
from phaseflip.rank.worker import failure, serve

AUTHKEY_ENV = "PHASEFLIP_RANK_AUTHKEY"   # the controller's listener key, hex: handed over in the environment


def set_threads(boot: RankBoot, world_size: int) -> None:
    """Ranks share the machine's cores: oversubscribed OpenMP threads spin against each other."""
    torch.set_num_threads(boot.num_threads or max(1, (os.cpu_count() or 1) // world_size))


def comm_device(boot: RankBoot, rank: int) -> str:
    return "cpu" if boot.device == "cpu" else f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"


def load_checkpoint(model_dir: str, dtype: torch.dtype):
    cfg = load_model_config(model_dir)
    return cfg, load_weights(model_dir, cfg, dtype)


def die_with_parent(parent_pid: int, pdeathsig: bool) -> None:
    """pdeathsig: the kernel kills this process when the THREAD that started it ends, so it is only
    asked for when that thread is the controller's main thread; the watchdog covers the rest."""
    try:  # Linux: the kernel kills this process when the controller dies
        if pdeathsig:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def main(rank: int, world_size: int, init_method: str, control: str, parent_pid: int, pdeathsig: bool) -> None:
    """Entry point of a rank process (`python -m phaseflip.engine.ranks.process ...`)."""
    die_with_parent(parent_pid, pdeathsig)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack
    conn = connect_back(control, bytes.fromhex(os.environ.pop(AUTHKEY_ENV)))
    conn.send(rank)
    boot: RankBoot = conn.recv()
    set_threads(boot, world_size)
    try:
        init_group(rank, world_size, boot.device, init_method)
    except Exception as e:  # noqa: BLE001
        conn.send(failure(rank, e))
        return
    comm = RankComm(rank, world_size, comm_device(boot, rank))
    serve(rank, lambda progress: RankRuntime(boot, rank, comm, load_checkpoint, progress), conn)
    os._exit(0)  # skip interpreter teardown: no hang in a half-closed process group


def connect_back(control: str, authkey: bytes):
    """The connection to the controller's listener: a socket path, or HOST:PORT."""
    if control.startswith("/"):
        return mp.connection.Client(control, family="AF_UNIX", authkey=authkey)
    host, port = control.rsplit(":", 1)
    return mp.connection.Client((host, int(port)), authkey=authkey)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6] == "1")
