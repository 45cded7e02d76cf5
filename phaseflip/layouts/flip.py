"""The flip on one rank: quiesce is the caller's; read -> exchange (the weight refill overlapped with
both) -> write -> cutover, every component timed, every stage agreed by all ranks, rollback before
cutover.

Owns: `run_flip`. It copies and only copies: no arena allocation, no weight packing, no capture
(restore, never rebuild). A stage that fails on any rank makes every rank roll back from what is
still on the host side: the send buffer, which holds every live KV byte of the rank (restored into
the source view), and the source layout's host image (refilled when the target's was already copied
in). The engine stays in the source layout.
"""
from __future__ import annotations

import threading
import time
import traceback

import torch

from phaseflip.layouts import reshard
from phaseflip.layouts.messages import FlipCommand, FlipReport


def _sync(rt) -> None:
    """On CUDA, wait for the stage's kernels, so its time is the copy's time and not its launch's."""
    if rt.kv.buffer.is_cuda:
        torch.cuda.synchronize(rt.kv.buffer.device)


class InjectedFault(RuntimeError):
    """A failure armed by a test (ArmFault)."""


class _Refill(threading.Thread):
    """The weight refill, run beside the KV read and exchange (LESSONS 3: overlap is the cheapest saving)."""
    def __init__(self, arena, layout: str):
        super().__init__(daemon=True)
        self.arena, self.layout = arena, layout
        self.bytes, self.ms, self.error = 0, None, None

    def run(self):
        t0 = time.perf_counter()
        try:
            if self.arena.buffer.is_cuda:  # a side stream, so the copy overlaps the exchange
                stream = torch.cuda.Stream(self.arena.buffer.device)
                with torch.cuda.stream(stream):
                    self.bytes = self.arena.refill(self.layout)
                stream.synchronize()
            else:
                self.bytes = self.arena.refill(self.layout)
        except BaseException as e:  # reported to the flip, which rolls back
            self.error = e
        self.ms = (time.perf_counter() - t0) * 1e3


class _Flip:
    def __init__(self, rt, cmd: FlipCommand):
        self.rt, self.cmd = rt, cmd
        self.src, self.dst = rt.active, cmd.target
        self.blocks = torch.tensor(cmd.live_blocks, dtype=torch.int64, device=rt.kv.buffer.device)
        self.ms: dict[str, float] = {}
        self.flat = self.received = None
        self.refill: _Refill | None = None
        self.splits: list[int] = []
        self.in_splits: list[int] = []
        self.kv_bytes = self.weight_bytes = 0
        self.refilled = self.wrote = False
        self.stage = "read"   # the component running now: what a failure is reported against

    def _timed(self, name, fn):
        self.stage = name
        t0 = time.perf_counter()
        try:
            fn()
        finally:
            self.ms[name] = (time.perf_counter() - t0) * 1e3
        self.rt.faults.check(name)

    def start_refill(self):
        """The weight refill starts first and runs beside the read and the exchange (it touches only
        the weight arena); it is joined before the write."""
        self.refill = _Refill(self.rt.arena, self.dst)
        self.refill.start()
        self.refilled = True

    def join_refill(self):
        if self.refill is not None and self.refill.is_alive():
            self.refill.join()
        if self.refill is not None:
            self.ms["refill"] = self.refill.ms
            self.weight_bytes = self.refill.bytes

    def read(self):
        """Copy the live blocks into the send buffer and prepare the exchange, so that anything that
        can fail locally fails here, before the ranks enter the all_to_all together."""
        rt, plan = self.rt, self.rt.layout_plan
        src_shards, dst_shards = plan.spec(self.src).shards, plan.spec(self.dst).shards
        self.start_refill()
        self.flat, self.in_splits = reshard.read(rt.kv.view(self.src), self.blocks, src_shards[rt.rank],
                                                 dst_shards)
        self.splits = reshard.recv_splits(src_shards, dst_shards[rt.rank], self.blocks.numel(),
                                          rt.kv_block_size, rt.cfg.head_dim)
        self.received = self.flat.new_empty(sum(self.splits))
        _sync(rt)

    def exchange_and_refill(self):
        try:
            self._timed("exchange", self._exchange)
        finally:
            self.join_refill()
        self.stage = "refill"
        if self.refill.error is not None:
            raise self.refill.error
        self.rt.faults.check("refill")

    def _exchange(self):
        rt = self.rt
        rt.comm.all_to_all(self.received, self.flat, self.splits, self.in_splits)
        _sync(rt)
        self.kv_bytes = (sum(self.in_splits) - self.in_splits[rt.rank]) * self.flat.element_size()

    def write(self):
        self.wrote = True
        plan = self.rt.layout_plan
        reshard.write(self.rt.kv.view(self.dst), self.received, self.splits, plan.spec(self.src).shards,
                      plan.spec(self.dst).shards[self.rt.rank], self.blocks)
        _sync(self.rt)

    def cutover(self):
        self.rt.active = self.dst

    def rollback(self):
        self.join_refill()
        if self.wrote:
            plan = self.rt.layout_plan
            reshard.restore(self.rt.kv.view(self.src), self.flat, self.in_splits,
                            plan.spec(self.src).shards[self.rt.rank], plan.spec(self.dst).shards, self.blocks)
        if self.refilled:
            self.rt.arena.refill(self.src)
        self.rt.active = self.src


def run_flip(rt, cmd: FlipCommand) -> FlipReport:
    """Flip this rank from rt.active to cmd.target. Every rank runs it together (collectives)."""
    f = _Flip(rt, cmd)
    t0 = time.perf_counter()
    stages = (("read", lambda: f._timed("read", f.read)), ("exchange", f.exchange_and_refill),
              ("write", lambda: f._timed("write", f.write)), ("cutover", lambda: f._timed("cutover", f.cutover)))
    for name, run in stages:
        error = None
        try:
            run()
        except Exception as e:  # noqa: BLE001 — any failure rolls back; it is reported, not swallowed
            error = (f.stage, f"{type(e).__name__}: {e}", traceback.format_exc())
        if rt.comm.any(error is not None):
            f.rollback()
            f.ms["total"] = (time.perf_counter() - t0) * 1e3
            stage, msg = (error[0], error[1]) if error else (name, "another rank failed this stage")
            return FlipReport(rt.rank, f.src, f.dst, ok=False, failed_stage=stage, error=msg, ms=f.ms,
                              kv_bytes=f.kv_bytes, weight_bytes=f.weight_bytes)
    f.ms["total"] = (time.perf_counter() - t0) * 1e3
    return FlipReport(rt.rank, f.src, f.dst, ok=True, ms=f.ms, kv_bytes=f.kv_bytes,
                      weight_bytes=f.weight_bytes)
