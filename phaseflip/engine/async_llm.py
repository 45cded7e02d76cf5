"""AsyncLLM: the engine behind an asyncio front, for the server and for Python callers.

Owns: one engine thread that boots an LLM and is then the only thread that touches it (scheduler,
ranks, sampler state). Between steps it takes the requests added and aborted since the last one, so
requests join the running batch as they arrive (continuous batching across callers); it runs steps
while there is work and hands every request's new pieces to its stream after each step (one
`call_soon_threadsafe` per event loop and step). The event loop never runs a step.

A stream that is closed before its request finished (a dropped HTTP connection, a cancelled task)
aborts the request: its sequences finish before the next step and their KV blocks are free.
Sequences waiting for a slot are bounded by `max_waiting`: beyond it `add` raises QueueFull before
anything is queued. A failed step ends the requests it held with the error; a dead engine (a rank
died) ends every stream with EngineDeadError, refuses new work, and calls its `on_dead` callbacks.
`shutdown(timeout_s)` refuses new work, lets running requests finish until the deadline, ends the
rest with EngineStopping, and shuts the ranks down.

At world size 1 the steps' CPU work runs on the engine thread. torch's OpenMP keeps a worker team per
thread that starts parallel work; with two such teams on a machine with as many cores as one team has
threads, OpenMP stops spinning at its barriers and every product pays a sleep and a wake. So a caller
whose own thread ran torch work before creating an AsyncLLM slows the engine (`phaseflip serve`'s
event-loop thread runs none).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import AsyncIterator, Callable

from phaseflip.engine.config import EngineConfig
from phaseflip.engine.core import StepOutcome
from phaseflip.engine.outputs import TextStream, metrics
from phaseflip.engine.prompts import PreparedPrompt
from phaseflip.engine.ranks.group import EngineDeadError
from phaseflip.engine.request_stream import EngineStopping, QueueFull, RequestStream, hand_over
from phaseflip.engine.requests import RequestOutput

log = logging.getLogger("phaseflip")

IDLE_WAIT_S = 0.5   # an idle engine thread re-checks its deadline this often
POLL_S = 0.02       # how often a caller awaiting the boot or the shutdown looks


class AsyncLLM:
    def __init__(self, model: str | None = None, *, max_waiting: int | None = None, **engine_options):
        EngineConfig.from_kwargs(model=model, **engine_options)   # a bad option raises here, not in the thread
        if max_waiting is not None and (not isinstance(max_waiting, int) or max_waiting < 1):
            raise ValueError(f"max_waiting={max_waiting!r} is invalid: must be an int >= 1 (or None: "
                             f"sized from the KV pool)")
        self.llm = None
        self.max_waiting = max_waiting
        self.dead: str | None = None
        self.boot_error: BaseException | None = None
        self.snapshot: dict = {}
        self.on_dead: list[Callable[[str], None]] = []
        self.observers: list[Callable[[StepOutcome, list[dict], dict], None]] = []  # engine thread
        self._lock = threading.Lock()
        self._inbox: deque = deque()          # ("add", RequestStream) | ("abort", request_id)
        self._pending_seqs = 0                # sequences added and not yet queued by the engine thread
        self._wake = threading.Event()
        self._booted = threading.Event()
        self._stopping = False
        self._deadline: float | None = None
        self._requests: dict[str, RequestStream] = {}   # engine thread: live requests
        self._of_seq: dict[int, RequestStream] = {}
        self._flips_seen = 0
        self.num_aborted = 0                  # requests aborted before they finished
        self._thread = threading.Thread(target=self._main, args=(model, engine_options),
                                        name="phaseflip-engine", daemon=True)
        self._thread.start()

    # -- the caller's side (an event loop) ---------------------------------------------------------
    @property
    def booted(self) -> bool:
        """The boot ended (well or not)."""
        return self._booted.is_set()

    @property
    def is_ready(self) -> bool:
        return self._booted.is_set() and self.llm is not None and not self.dead and not self._stopping

    async def ready(self) -> None:
        """Wait for the boot; raises what the boot raised. (It polls: an executor thread blocked on
        the boot would hold up the interpreter's exit until the boot ended.)"""
        while not self._booted.is_set():
            await asyncio.sleep(POLL_S)
        if self.boot_error is not None:
            raise self.boot_error

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    def prepare(self, prompts, sampling_params=None) -> list[PreparedPrompt]:
        """Prompts checked and tokenized (LLM.prepare's rules): a bad one raises, naming it; so does a
        request of more sequences than the waiting queue can ever hold (a retry could never succeed)."""
        self._check_open()
        prepared = self.llm.prepare(prompts, sampling_params)
        num_seqs = sum(p.params.n for p in prepared)
        if num_seqs > self.max_waiting:
            n = sorted({p.params.n for p in prepared})
            raise ValueError(f"n={n[0] if len(n) == 1 else n} over {len(prepared)} prompt(s) is {num_seqs} "
                             f"sequences: more than the waiting queue ever holds (max_waiting={self.max_waiting})")
        return prepared

    def add(self, prepared: list[PreparedPrompt], request_id: str) -> list[RequestStream]:
        """Queue these prompts (all or none) as requests `request_id-i` and return their streams."""
        self._check_open()
        num_seqs = sum(p.params.n for p in prepared)
        with self._lock:
            waiting = self.snapshot.get("waiting", 0) + self._pending_seqs
            if waiting + num_seqs > self.max_waiting:
                raise QueueFull(f"{waiting} sequences are waiting (max_waiting={self.max_waiting}); "
                                f"this request adds {num_seqs}")
            streams = [RequestStream(self, request_id if len(prepared) == 1 else f"{request_id}-{i}", p)
                       for i, p in enumerate(prepared)]
            self._inbox.extend(("add", s) for s in streams)
            self._pending_seqs += num_seqs
            self._wake.set()
        return streams

    async def generate(self, prompt, sampling_params=None, request_id: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """One prompt's pieces as they are produced (see RequestStream)."""
        prepared = self.prepare(prompt, sampling_params)
        if len(prepared) != 1:
            raise ValueError(f"generate takes one prompt; got {len(prepared)} (call it once per prompt)")
        (stream,) = self.add(prepared, request_id or f"req-{time.monotonic_ns()}")
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        """End this request before its next step (a no-op once it finished)."""
        with self._lock:
            self._inbox.append(("abort", request_id))
            self._wake.set()

    def _check_open(self) -> None:
        if self.dead:
            raise EngineDeadError(f"engine is dead: {self.dead}")
        if self._stopping:
            raise EngineStopping("the engine is shutting down and takes no new request")
        if self.llm is None or not self._booted.is_set():
            raise EngineStopping("the engine is still booting") if self.boot_error is None else self.boot_error

    def begin_shutdown(self, timeout_s: float) -> None:
        """Refuse new requests; running ones may finish for timeout_s, then they end with EngineStopping."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._stopping = True
            self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)
            self._wake.set()

    async def shutdown(self, timeout_s: float = 0.0) -> None:
        self.begin_shutdown(timeout_s)
        while self._thread.is_alive():
            await asyncio.sleep(POLL_S)

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the engine thread (it ends after shutdown, or after a failed boot)."""
        self._thread.join(timeout_s)

    # -- the engine thread ---------------------------------------------------------------------------
    def _main(self, model, engine_options) -> None:
        from phaseflip.engine.llm import LLM
        try:
            self.llm = LLM(model, **engine_options)
        except BaseException as e:  # noqa: BLE001 — handed to ready()
            self.boot_error = e
            self._booted.set()
            return
        if self.max_waiting is None:
            self.max_waiting = max(2 * self.llm.config.max_num_seqs, self.llm.plan.num_kv_blocks)
        self._publish()
        self._booted.set()
        try:
            self._serve()
        finally:
            self._end_all(self._final_error())
            self.llm.shutdown()

    def _serve(self) -> None:
        core = self.llm.core
        while True:
            self._take_inbox()
            if self._stopping and (not core.has_unfinished() or time.monotonic() >= self._deadline):
                return
            if not core.has_unfinished():
                self.llm.forget_finished()
                self._publish()
                self._wait_for_work()
                continue
            try:
                outcome = core.step()
            except Exception as e:  # noqa: BLE001 — the requests it held end with it; a dead engine stops
                self._after_failure(e)
                if self.dead:
                    return
                continue
            self._deliver(outcome)

    def _wait_for_work(self) -> None:
        with self._lock:
            if self._inbox or self._stopping:
                return
            self._wake.clear()
        self._wake.wait(IDLE_WAIT_S)

    def _take_inbox(self) -> None:
        with self._lock:
            commands = list(self._inbox)
            self._inbox.clear()
        for kind, what in commands:
            if kind == "add":
                self._queue(what)
            else:
                self._abort(what)
        if commands:
            self._publish()

    def _queue(self, stream: RequestStream) -> None:
        try:
            seqs = self.llm.submit(stream.prepared, stream.request_id)
        except Exception as e:  # noqa: BLE001 — this request's error, not the engine's
            hand_over([(stream, e)])
            seqs = []
        finally:
            with self._lock:
                self._pending_seqs -= stream.prepared.params.n
        if seqs:
            stream.text_streams = [TextStream(s, i, self.llm.tokenizer) for i, s in enumerate(seqs)]
            self._requests[stream.request_id] = stream
            self._of_seq.update((s.seq_id, stream) for s in seqs)

    def _abort(self, request_id: str) -> None:
        stream = self._requests.get(request_id)
        if stream is not None:
            self.num_aborted += 1
            self.llm.core.abort([t.seq.seq_id for t in stream.text_streams])
            self._forget(stream)

    def _deliver(self, outcome: StepOutcome) -> None:
        touched = {}   # request id -> stream, in the step's order
        for seq in (*outcome.sampled, *outcome.finished):
            stream = self._of_seq.get(seq.seq_id)
            if stream is not None:
                touched[stream.request_id] = stream
        items = []
        for stream in touched.values():
            pieces = [p for t in stream.text_streams if (p := t.next_piece()) is not None]
            seqs = [t.seq for t in stream.text_streams]
            finished = all(s.is_finished for s in seqs)
            out = RequestOutput(stream.request_id, stream.prepared.prompt, stream.prepared.token_ids, pieces,
                                finished, metrics(seqs[0]), seqs[0].prompt_logprobs)
            items.append((stream, out))
            if finished:
                self._forget(stream)
        self._publish(outcome)   # first: a caller that sees its request finish sees its blocks free
        hand_over(items)

    def _forget(self, stream: RequestStream) -> None:
        del self._requests[stream.request_id]
        for t in stream.text_streams:
            del self._of_seq[t.seq.seq_id]

    def _after_failure(self, error: Exception) -> None:
        log.error("a step failed; the requests it held end with the error: %s", error)
        try:
            self.llm.recover()
        except Exception as again:  # noqa: BLE001 — the engine's death, reported to every request
            error = again
        if self.llm.ranks.dead:
            self.dead = self.llm.ranks.dead
        self._end_all(EngineDeadError(f"engine is dead: {self.dead}") if self.dead else error)
        if self.dead:
            for callback in self.on_dead:
                callback(self.dead)

    def _final_error(self) -> BaseException:
        if self.dead:
            return EngineDeadError(f"engine is dead: {self.dead}")
        return EngineStopping("the engine shut down before this request finished")

    def _end_all(self, error: BaseException) -> None:
        """Every live request ends with `error` (and is aborted); so do requests not yet queued."""
        self._take_inbox_as_failed(error)
        streams = list(self._requests.values())
        for stream in streams:
            self._abort(stream.request_id)
        hand_over([(stream, error) for stream in streams])
        self._publish()

    def _take_inbox_as_failed(self, error: BaseException) -> None:
        with self._lock:
            commands = list(self._inbox)
            self._inbox.clear()
            self._pending_seqs = 0
        hand_over([(what, error) for kind, what in commands if kind == "add"])

    def _publish(self, outcome: StepOutcome | None = None) -> None:
        """The numbers the front reads (queue bound, /health, /metrics), then the observers."""
        llm = self.llm
        sched, alloc, control = llm.core.scheduler, llm.allocator, llm.control
        total_flips = control.num_flips + control.num_failed_flips
        num_new = min(total_flips - self._flips_seen, len(control.flip_log))
        new_flips = list(control.flip_log)[-num_new:] if num_new else []
        self._flips_seen = total_flips
        self.snapshot = {"running": sched.num_running, "waiting": sched.num_waiting,
                         "kv_blocks_total": alloc.num_total_blocks, "kv_blocks_free": alloc.num_free_blocks,
                         "prefix_cache": alloc.cache_stats(), "active_layout": control.active,
                         "flips": control.num_flips, "failed_flips": control.num_failed_flips,
                         "steps": llm.core.num_steps, "aborted": self.num_aborted}
        for observe in self.observers:
            observe(outcome or StepOutcome(), new_flips, self.snapshot)
