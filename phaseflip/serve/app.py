"""The ASGI app of `phaseflip serve`: OpenAI's routes over an AsyncLLM, and what guards them.

Owns: the routes (/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, /health,
/version, /metrics),
the mapping of every refusal to OpenAI's error object (400 bad input naming the field, 401 without
the API key, 404 an unknown model, 413 a body over the limit, 503 a full queue with Retry-After, a
booting or dead engine), and two guards that run before a body is parsed: the body-size limit and the
API key (compared in constant time). The key guards /v1/*, /tokenize and /detokenize: /health, /version
and /metrics stay open for probes and scrapers, as in vLLM (which leaves its tokenizer routes open too).
"""
from __future__ import annotations

import hmac
import json
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, Response

from phaseflip import __version__
from phaseflip.engine.request_stream import EngineStopping, QueueFull
from phaseflip.engine.ranks.group import EngineDeadError
from phaseflip.serve.generation import APIError, Served, chat, complete
from phaseflip.serve.metrics import ServingMetrics
from phaseflip.serve.protocol import ChatCompletionRequest, CompletionRequest
from phaseflip.serve.responses import ModelCard, ModelList
from phaseflip.serve.tokens import DetokenizeRequest, detokenize, tokenize, tokenize_body

RETRY_AFTER_S = 1   # what a 503 for a full queue tells the client to wait


def build_app(served: Served, metrics: ServingMetrics, *, api_key: str | None = None,
              max_request_bytes: int = 8 << 20) -> FastAPI:
    app = FastAPI(title="phaseflip", version=__version__, docs_url=None, redoc_url=None)
    _errors(app)
    _routes(app, served, metrics)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(APIKey, key=api_key)
    return app


def _routes(app: FastAPI, served: Served, metrics: ServingMetrics) -> None:
    engine = served.engine
    started = int(time.time())

    def ready() -> None:
        if engine.dead:
            raise EngineDeadError(f"engine is dead: {engine.dead}")
        if not engine.is_ready:
            raise EngineStopping("the engine is booting" if engine.llm is None else "the engine is shutting down")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        ready()
        return await complete(served, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        ready()
        return await chat(served, body, request)

    @app.get("/v1/models")
    async def models():
        ready()
        card = ModelCard(id=served.name, created=started, root=served.root,
                         max_model_len=engine.llm.plan.max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        ready()
        try:
            data = await request.json()
        except ValueError as e:
            raise APIError(400, f"the body is not valid JSON: {e}", "body") from None
        return tokenize(served, tokenize_body(data)).model_dump()

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest):
        ready()
        return detokenize(served, body).model_dump()

    @app.get("/health")
    async def health():
        if engine.is_ready:
            return Response(status_code=200)
        reason = engine.dead or ("booting" if engine.llm is None else "shutting down")
        return JSONResponse({"status": reason}, status_code=503)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _errors(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        return _invalid_body(e.errors()).response()

    @app.exception_handler(QueueFull)
    async def queue_full(request, e: QueueFull):
        return APIError(503, str(e), headers={"Retry-After": str(RETRY_AFTER_S)}).response()

    @app.exception_handler(EngineDeadError)
    @app.exception_handler(EngineStopping)
    async def unavailable(request, e: Exception):
        return APIError(503, str(e)).response()


def _invalid_body(errors: list[dict]) -> APIError:
    """pydantic's first complaint as one message naming the field (messages.0.content, max_tokens)."""
    first = errors[0]
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                        "body")
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"unsupported field `{where}`: phaseflip does not implement it", where)
    message = first["msg"].removeprefix("Value error, ")
    got = first.get("input")
    shown = "" if first.get("type") in ("missing",) else f" (got {json.dumps(got, default=repr)[:80]})"
    return APIError(400, f"{where}: {message}{shown}" if where else message, where or None)


class BodyLimit:
    """Refuses a body over max_bytes with 413 before the app reads it: at once when Content-Length
    says so, else as soon as the chunks received pass it."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        received, refused = 0, False

        async def counted():
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                refused = True
                await self._refuse(scope, receive, send)
                return {"type": "http.disconnect"}
            return message

        async def unless_refused(message):
            if not refused:
                await send(message)
        await self.app(scope, counted, unless_refused)

    async def _refuse(self, scope, receive, send):
        error = APIError(413, f"the request body is over the limit of {self.max_bytes} bytes", "body")
        await error.response()(scope, receive, send)


GUARDED = ("/v1", "/tokenize", "/detokenize")   # the paths the API key guards (prefixes)


class APIKey:
    """The GUARDED paths need `Authorization: Bearer <key>`; a request without it gets 401."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(GUARDED):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.key):
                error = APIError(401, "a valid API key is needed: send 'Authorization: Bearer <key>'")
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)
