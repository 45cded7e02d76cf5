"""A request's stream between the engine thread and an asyncio caller, and the errors of its queueing.

Owns: RequestStream (the asyncio queue a request's pieces arrive on, iterated by the caller; closing
it early aborts the request), `hand_over` (the engine thread's one call per event loop and step that
puts pieces on their streams), and the refusals QueueFull and EngineStopping.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, AsyncIterator

from phaseflip.engine.outputs import TextStream
from phaseflip.engine.prompts import PreparedPrompt
from phaseflip.engine.requests import RequestOutput

if TYPE_CHECKING:
    from phaseflip.engine.async_llm import AsyncLLM


class QueueFull(RuntimeError):
    """The waiting queue is at max_waiting sequences: try again later."""


class EngineStopping(RuntimeError):
    """The engine is shutting down: it takes no new request and ends those left at its deadline."""


class RequestStream:
    """One request's pieces as the engine produces them: `async for out in stream` yields
    RequestOutputs whose CompletionOutputs hold only what is new (text, token ids, logprobs), the
    last one with finished=True. Closing it (or leaving the loop) early aborts the request."""

    def __init__(self, engine: AsyncLLM, request_id: str, prepared: PreparedPrompt):
        self.engine, self.request_id, self.prepared = engine, request_id, prepared
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.text_streams: list[TextStream] = []   # the engine thread's, once it queued the samples

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            self.close()

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


def hand_over(items: list) -> None:
    """From the engine thread: put each (stream, piece or error) on its stream's queue, with one call
    into each event loop the streams belong to."""
    by_loop: dict = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, its in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put, its)
        except RuntimeError:  # the loop is closed: nobody reads these streams any more
            pass


def _put(items: list) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)
