"""The flip on one rank: quiesce is the caller's; the live KV moves a chunk of blocks at a time
(read -> exchange -> write) through a staging buffer of fixed size, the weight refill runs beside it,
then cutover. Every component is timed and every stage agreed by all ranks; rollback before cutover.

Owns: `Staging` (the send and receive buffers, allocated once at boot) and `run_flip`. The flip
copies and only copies: no allocation, no weight packing, no capture (restore, never rebuild).
Chunking is safe because the KV region is block-major (rank/kvcache.py): writing a chunk's blocks
in the target view rewrites those blocks' bytes and no others, and they were read first.

A stage that fails on any rank makes every rank roll back. What a rollback needs is never more than
the staging buffer holds: the chunk in flight is restored from the send buffer (it holds every byte
of those blocks the rank had), the chunks already moved are moved back (the target layout holds
them whole), and the source layout's weight image is refilled when the target's was copied in. The
engine stays in the source layout.
"""
from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass

import torch

from phaseflip.rank import reshard
from phaseflip.rank.kvcache import KVShape, zeros
from phaseflip.rank.messages import FlipCommand, FlipReport

DEFAULT_STAGING_BYTES = 256 << 20   # the default is the smaller of this and a tenth of the KV pool
DEFAULT_STAGING_FRACTION = 0.1


def _sync(rt) -> None:
    """On CUDA, wait for the stage's kernels, so its time is the copy's time and not its launch's."""
    if rt.kv.buffer.is_cuda:
        torch.cuda.synchronize(rt.kv.buffer.device)


class InjectedFault(RuntimeError):
    """A failure armed by a test (ArmFault)."""


@dataclass(frozen=True)
class Staging:
    """The flip's send and receive buffers: `chunk_blocks` blocks of the largest per-rank block of
    either layout each, the same chunk on every rank (the exchange is a collective)."""
    send: torch.Tensor
    recv: torch.Tensor
    chunk_blocks: int

    @property
    def num_bytes(self) -> int:
        return (self.send.numel() + self.recv.numel()) * self.send.element_size()


def allocate_staging(plan, layouts, head_dim: int, block_size: int, num_blocks: int, dtype: torch.dtype,
                     device, requested_bytes: int | None) -> Staging | None:
    """None with a single layout (nothing flips). requested_bytes None: the default; a request
    smaller than two blocks still gets one block each way."""
    if len(layouts) < 2:
        return None
    block = max(KVShape(s.layers.count, 1, block_size, s.kv_heads.count, head_dim).block_numel
                for name in layouts for s in plan.spec(name).shards)  # elements, the largest anywhere
    block_bytes = block * torch.empty((), dtype=dtype).element_size()
    if requested_bytes is None:
        requested_bytes = min(DEFAULT_STAGING_BYTES, int(DEFAULT_STAGING_FRACTION * num_blocks * block_bytes))
    chunk = max(1, min(num_blocks, requested_bytes // (2 * block_bytes)))
    return Staging(zeros(chunk * block, dtype, device), zeros(chunk * block, dtype, device), chunk)


class _Refill(threading.Thread):
    """The weight refill, run beside the KV moves (overlap is the cheapest saving a flip has)."""
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
        self.rt = rt
        self.src, self.dst = rt.active, cmd.target
        blocks = torch.tensor(cmd.live_blocks, dtype=torch.int64, device=rt.kv.buffer.device)
        self.chunks = blocks.split(rt.staging.chunk_blocks) if blocks.numel() else ()
        self.ms: dict[str, float] = {"read": 0.0, "exchange": 0.0, "write": 0.0}
        self.refill = _Refill(rt.arena, self.dst)
        self.kv_bytes = 0
        self.moved = 0            # chunks written on every rank (agreed)
        self.in_flight = None     # (chunk, its send splits) once this rank began writing it
        self.stage, self.chunk = "read", None   # what runs now: what a failure is reported against

    def steps(self):
        """(name, chunk index, what it runs): all ranks agree on each before the next begins."""
        for c, blocks in enumerate(self.chunks):
            yield "chunk", c, lambda c=c, b=blocks: self._move(c, b)
        yield "refill", None, self._join_refill
        yield "cutover", None, self._cutover

    def run_step(self, name: str, chunk: int | None, fn) -> None:
        self.stage, self.chunk = name, chunk
        fn()

    def agreed(self, name: str) -> None:
        if name == "chunk":
            self.moved, self.in_flight = self.moved + 1, None

    # -- the legs of one chunk, in either direction ------------------------------------------------
    def _splits(self, frm: str, to: str, n: int) -> tuple[list[int], list[int]]:
        """(elements sent to, received from) each rank for n blocks."""
        plan, rt = self.rt.layout_plan, self.rt
        src, dst = plan.spec(frm).shards, plan.spec(to).shards
        return (reshard.splits(src[rt.rank], dst, n, rt.kv_block_size, rt.cfg.head_dim),
                reshard.splits(dst[rt.rank], src, n, rt.kv_block_size, rt.cfg.head_dim))

    def _read_leg(self, frm: str, to: str, blocks: torch.Tensor) -> None:
        plan = self.rt.layout_plan
        reshard.read(self.rt.kv.view(frm), blocks, plan.spec(frm).shards[self.rt.rank], plan.spec(to).shards,
                     self.rt.staging.send)
        _sync(self.rt)

    def _exchange_leg(self, sent: list[int], received: list[int]) -> None:
        staging = self.rt.staging
        self.rt.comm.all_to_all(staging.recv[:sum(received)], staging.send[:sum(sent)], received, sent)
        _sync(self.rt)

    def _write_leg(self, frm: str, to: str, blocks: torch.Tensor, received: list[int]) -> None:
        plan = self.rt.layout_plan
        reshard.write(self.rt.kv.view(to), self.rt.staging.recv, received, plan.spec(frm).shards,
                      plan.spec(to).shards[self.rt.rank], blocks)
        _sync(self.rt)

    # -- the forward flip --------------------------------------------------------------------------
    def _timed(self, stage: str, chunk: int, fn) -> None:
        self.stage = stage
        t0 = time.perf_counter()
        try:
            fn()
        finally:
            self.ms[stage] += (time.perf_counter() - t0) * 1e3
        self.rt.faults.check(stage, chunk)

    def _move(self, c: int, blocks: torch.Tensor) -> None:
        """One chunk, one agreement. The exchange runs even when this rank's read failed (the other
        ranks are in the collective; what they receive from it then is garbage, and each of them
        restores the chunk from its own send buffer in the rollback); the write runs only when the read
        and the exchange succeeded here. The first failure is raised after the exchange."""
        sent, received = self._splits(self.src, self.dst, blocks.numel())
        failure = None
        for stage, fn in (("read", lambda: self._read_leg(self.src, self.dst, blocks)),
                          ("exchange", lambda: self._exchange_leg(sent, received))):
            try:
                self._timed(stage, c, fn)
            except Exception as e:  # noqa: BLE001 — raised below, after the collective
                failure = failure or (stage, e)
        if failure is not None:
            self.stage = failure[0]
            raise failure[1]
        self.kv_bytes += (sum(sent) - sent[self.rt.rank]) * self.rt.staging.send.element_size()
        self.in_flight = (c, sent)
        self._timed("write", c, lambda: self._write_leg(self.src, self.dst, blocks, received))

    def _join_refill(self):
        self.refill.join()
        self.ms["refill"] = self.refill.ms
        if self.refill.error is not None:
            raise self.refill.error
        self.rt.faults.check("refill")

    def _cutover(self):
        t0 = time.perf_counter()
        self.rt.active = self.dst
        self.ms["cutover"] = (time.perf_counter() - t0) * 1e3
        self.rt.faults.check("cutover")

    # -- rollback ----------------------------------------------------------------------------------
    def rollback(self):
        """Back to the source layout: the chunk whose write began from the send buffer (locally), the
        chunks already moved by moving them back (collectively, through the same staging)."""
        t0 = time.perf_counter()
        rt = self.rt
        self.refill.join()
        if self.in_flight is not None:
            c, sent = self.in_flight
            src, dst = rt.layout_plan.spec(self.src).shards, rt.layout_plan.spec(self.dst).shards
            reshard.restore(rt.kv.view(self.src), rt.staging.send, sent, src[rt.rank], dst, self.chunks[c])
        for blocks in self.chunks[:self.moved]:
            sent, received = self._splits(self.dst, self.src, blocks.numel())
            self._read_leg(self.dst, self.src, blocks)
            self._exchange_leg(sent, received)
            self._write_leg(self.dst, self.src, blocks, received)
        rt.arena.refill(self.src)
        rt.active = self.src
        _sync(rt)
        self.ms["rollback"] = (time.perf_counter() - t0) * 1e3

    def report(self, t0: float, **failure) -> FlipReport:
        self.ms["total"] = (time.perf_counter() - t0) * 1e3
        return FlipReport(self.rt.rank, self.src, self.dst, ok=not failure, ms=self.ms, kv_bytes=self.kv_bytes,
                          weight_bytes=self.refill.bytes, chunks=len(self.chunks),
                          staging_bytes=self.rt.staging.num_bytes, **failure)


def run_flip(rt, cmd: FlipCommand) -> FlipReport:
    """Flip this rank from rt.active to cmd.target. Every rank runs it together (collectives)."""
    f = _Flip(rt, cmd)
    t0 = time.perf_counter()
    f.refill.start()  # beside the KV moves: it touches only the weight arena
    for stage, chunk, fn in f.steps():
        error = None
        try:
            f.run_step(stage, chunk, fn)
        except Exception as e:  # noqa: BLE001 — any failure rolls back; it is reported, not swallowed
            error = (f.stage, f.chunk, f"{type(e).__name__}: {e}", traceback.format_exc())
        if rt.comm.any(error is not None):
            f.rollback()
            stage, chunk, msg = error[:3] if error else (stage, chunk, "another rank failed this stage")
            return f.report(t0, failed_stage=stage, failed_chunk=chunk, error=msg)
        f.agreed(stage)
    return f.report(t0)
