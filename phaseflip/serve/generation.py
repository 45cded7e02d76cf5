"""From an accepted OpenAI request to its answer: engine streams in, server-sent events or one body out.

Owns: checking a request against the served model (its name, the context length), queueing its
prompts on the AsyncLLM, and answering: with stream=true one `data:` event per piece (OpenAI's chunk
format), an error event if the engine fails mid-way, the usage chunk when asked, `data: [DONE]`; else
the whole body once every sample finished. Whatever ends a request's answer early (a closed
connection, a cancelled task, an error) closes its streams, which aborts what is still running.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import uuid
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from phaseflip.engine.async_llm import AsyncLLM
from phaseflip.engine.ranks.group import EngineDeadError
from phaseflip.engine.prompts import PreparedPrompt
from phaseflip.engine.request_stream import EngineStopping, RequestStream
from phaseflip.engine.requests import CompletionOutput
from phaseflip.serve.protocol import ChatCompletionRequest, CompletionRequest
from phaseflip.serve.responses import ChatView, CompletionView, ErrorInfo, ErrorResponse

CLIENT_CLOSED = 499   # nginx's status for a request whose client went away before the answer


class APIError(Exception):
    """An answer other than 200: its HTTP status, OpenAI's error type and the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.kind = kind or {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                             413: "RequestTooLarge", 503: "ServiceUnavailableError"}.get(status, "InternalServerError")

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.kind, param=self.param,
                                             code=self.status))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


def bad_value(error: Exception, body, default_param: str) -> APIError:
    """A ValueError/TypeError of the engine's checks as a 400. Its message names the value
    ("max_tokens=-1 is invalid: ..."), in the engine's words: a value the request set under another
    name (chat's top_logprobs, max_completion_tokens) is named as the request named it. The first of the
    body's fields the message names is the error's param."""
    message = str(error)
    head = re.match(r"(\w+)=", message)
    if head and body.field_of(head[1]) != head[1]:
        message = body.field_of(head[1]) + message[len(head[1]):]
    named = [(m.start(), name) for name in type(body).model_fields
             if (m := re.search(rf"\b{name}\b", message)) is not None]
    return APIError(400, message, min(named)[1] if named else default_param)


class Served:
    """The model this server serves, and the engine behind it."""

    def __init__(self, engine: AsyncLLM, name: str, root: str):
        self.engine, self.name, self.root = engine, name, root

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.name}`",
                           "model")

    def prepare(self, prompts, body, field: str) -> list:
        try:
            params = body.sampling_params(self.engine.llm.generation_defaults)
            prepared = self.engine.prepare(prompts, params)
        except (ValueError, TypeError) as e:
            raise bad_value(e, body, field) from None
        return [self._within_context(p, body, field) for p in prepared]

    def _within_context(self, p: PreparedPrompt, body, field: str) -> PreparedPrompt:
        """A max_tokens the request set that passes the context is refused; one it left to a default (the
        model's generation_config, completions' 16) is cut to what the context leaves, as vLLM does."""
        max_len, wanted = self.engine.llm.plan.max_model_len, p.params.max_tokens
        if wanted is None or len(p.token_ids) + wanted <= max_len:
            return p
        named = body.max_tokens_named()
        if named is None:
            cut = dataclasses.replace(p.params, max_tokens=max_len - len(p.token_ids))
            return dataclasses.replace(p, params=cut)
        raise APIError(400, f"this model's maximum context length is {max_len} tokens; the request asks for "
                            f"{len(p.token_ids) + wanted} ({len(p.token_ids)} in the {field}, {wanted} to "
                            f"generate): lower {named}", named)


async def complete(served: Served, body: CompletionRequest, request: Request):
    served.check_model(body.model)
    prepared = served.prepare(body.prompts(), body, "prompt")
    view = CompletionView(f"cmpl-{uuid.uuid4().hex}", served.name, prepared, body.n, served.engine.tokenizer,
                          body.echo, body.echo_only)
    return await _answer(served, view, prepared, body, request)


async def chat(served: Served, body: ChatCompletionRequest, request: Request):
    served.check_model(body.model)
    tokenizer = served.engine.tokenizer
    _, token_ids = templated(tokenizer, body.messages, body.add_generation_prompt)
    prepared = served.prepare([token_ids], body, "messages")
    view = ChatView(f"chatcmpl-{uuid.uuid4().hex}", served.name, prepared, body.n, tokenizer,
                    body.top_logprobs or 0)
    return await _answer(served, view, prepared, body, request)


def templated(tokenizer, messages, add_generation_prompt: bool, **options) -> tuple[str, list[int]]:
    """A chat's prompt (text, token ids) by the model's template (encode_chat's options); a template
    error is the request's (its roles, its order): a 400 naming `messages`."""
    try:
        return tokenizer.encode_chat([m.as_template_message() for m in messages], add_generation_prompt, **options)
    except Exception as e:  # noqa: BLE001
        raise APIError(400, f"the chat template refused these messages: {e}", "messages") from None


async def _answer(served: Served, view, prepared, body, request: Request):
    streams = served.engine.add(prepared, view.id)
    if body.stream:
        return EventStream(streams, _events(view, streams, body.include_usage, body.continuous_usage))
    try:
        whole = await _unless_disconnected(request, _collect(streams, view))
    finally:
        for s in streams:
            s.close()
    if whole is None:   # the client went away (its requests were aborted just above): nobody reads this
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(view.response(whole).model_dump())


class EventStream(StreamingResponse):
    """Server-sent events whose request streams are closed however the response ends."""

    def __init__(self, streams: list[RequestStream], events: AsyncIterator[str]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.streams = streams

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self.streams:
                s.close()


async def _events(view, streams: list[RequestStream], include_usage: bool,
                  continuous_usage: bool) -> AsyncIterator[str]:
    try:
        async for i, out in _merged(streams):
            view.note_prompt(i, out)
            view.count(i, out.outputs)
            for piece in out.outputs:   # one choice a chunk, as OpenAI and vLLM send them
                if piece.text or piece.finish_reason or piece.logprobs:   # not a held-back step
                    chunk = view.chunk(i, [piece])
                    if continuous_usage:
                        chunk.usage = view.choice_usage(i, piece)
                    yield f"data: {chunk.model_dump_json()}\n\n"
        if include_usage:
            yield f"data: {view.usage_chunk().model_dump_json()}\n\n"
    except Exception as e:  # noqa: BLE001 — the engine failed under this request: say so in the stream
        error = APIError(503 if _is_unavailable(e) else 500, str(e))
        yield f"data: {json.dumps(error.body().model_dump())}\n\n"
    yield "data: [DONE]\n\n"


def _is_unavailable(error: Exception) -> bool:
    return isinstance(error, (EngineDeadError, EngineStopping))


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, object]]:
    """(prompt index, piece) from every stream as they come; one stream is read directly."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream):
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as e:  # noqa: BLE001 — re-raised by the reader
            await queue.put((i, e))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _collect(streams: list[RequestStream], view) -> list[list[CompletionOutput]]:
    """Every sample of every prompt, joined from its pieces (the view notes each prompt's logprobs)."""
    joined: list[dict[int, dict]] = [{} for _ in streams]
    async for i, out in _merged(streams):
        view.note_prompt(i, out)
        for piece in out.outputs:
            acc = joined[i].setdefault(piece.index, {"text": [], "token_ids": [], "logprobs": None})
            acc["text"].append(piece.text)
            acc["token_ids"] += piece.token_ids
            if piece.logprobs is not None:
                acc["logprobs"] = (acc["logprobs"] or []) + piece.logprobs
            acc["finish_reason"], acc["stop_reason"] = piece.finish_reason, piece.stop_reason
    return [[CompletionOutput(index=j, text="".join(a["text"]), token_ids=a["token_ids"],
                              finish_reason=a["finish_reason"], stop_reason=a["stop_reason"],
                              logprobs=a["logprobs"]) for j, a in sorted(samples.items())]
            for samples in joined]


async def _unless_disconnected(request: Request, work):
    """`work`'s result, or None when the client goes away first (then `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        return None
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
