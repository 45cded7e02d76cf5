"""Running `phaseflip serve`: uvicorn over the app, the engine's boot, its end and the exit code.

Owns: the process's life as a server. uvicorn listens at once (so /health answers 503 while the
engine boots on its own thread); a boot failure or a dead engine stops the server with exit code 1.
SIGTERM or Ctrl-C stops accepting connections, lets the requests in flight run for
`shutdown_timeout_s`, ends those left with an error event, shuts the ranks down and exits 0 (during
the boot it exits at once; the ranks die with the process).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from dataclasses import dataclass

import uvicorn

from phaseflip.engine.async_llm import AsyncLLM
from phaseflip.engine.checkpoint.default_model import DEFAULT_MODEL_NAME
from phaseflip.engine.ranks import listener
from phaseflip.serve.app import build_app
from phaseflip.serve.generation import Served
from phaseflip.serve.metrics import ServingMetrics

log = logging.getLogger("phaseflip")

UVICORN_GRACE_S = 2.0   # uvicorn's own cut comes this long after the engine ended what was left
JOIN_GRACE_S = 30.0     # the engine thread's time to shut the ranks down after the server stopped


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_waiting: int | None = None
    shutdown_timeout_s: float = 10.0
    max_request_bytes: int = 8 << 20
    log_level: str = "info"

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} is invalid: must be in [0, 65535]")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout={self.shutdown_timeout_s} is invalid: must be >= 0 seconds")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes={self.max_request_bytes} is invalid: must be >= 1024")


class _Server(uvicorn.Server):
    """uvicorn's server, whose exit (a signal, or the engine's death) also starts the engine's end."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, shutdown_timeout_s: float):
        super().__init__(config)
        self.engine, self.shutdown_timeout_s = engine, shutdown_timeout_s
        self.failure: str | None = None

    def handle_exit(self, sig, frame) -> None:
        """uvicorn's, less its re-raising of the signal once the server stopped (which would kill the
        process before the ranks are shut down): a second Ctrl-C ends what is left at once."""
        again = self.should_exit
        self.engine.begin_shutdown(0.0 if again else self.shutdown_timeout_s)
        if again and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True

    def fail(self, reason: str) -> None:
        """From any thread: stop serving, and exit non-zero."""
        self.failure = reason
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        asyncio.ensure_future(self._watch_boot())

    async def _watch_boot(self) -> None:
        try:
            await self.engine.ready()
        except BaseException as e:  # noqa: BLE001 — the boot's failure ends the server
            if self.should_exit:   # a signal stopped the boot: no failure of the engine's
                log.info("phaseflip serve: stopped while booting")
                return
            reason = str(e) or type(e).__name__
            log.error("the engine failed to boot: %s", reason)
            self.fail(f"boot failed: {reason}")
            return
        log.info("phaseflip serve: ready on http://%s:%d", self.config.host, self.config.port)


def serve(engine_options: dict, config: ServeConfig) -> int:
    """Boot and serve until a signal or the engine's death; returns the process's exit code."""
    engine = AsyncLLM(max_waiting=config.max_waiting, **engine_options)
    root = engine_options.get("model") or DEFAULT_MODEL_NAME
    name = config.served_model_name or str(root)
    metrics = ServingMetrics(name, _layouts(engine_options))
    engine.observers.append(metrics.observe)
    app = build_app(Served(engine, name, root), metrics, api_key=config.api_key,
                    max_request_bytes=config.max_request_bytes)
    server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                    timeout_graceful_shutdown=config.shutdown_timeout_s + UVICORN_GRACE_S),
                     engine, config.shutdown_timeout_s)
    engine.on_dead.append(server.fail)
    try:
        server.run()
    finally:
        engine.begin_shutdown(0.0)
        engine.join(config.shutdown_timeout_s + JOIN_GRACE_S if engine.booted else 0.0)
    if server.failure:
        log.error("phaseflip serve stopped: %s", server.failure)
    code = 1 if server.failure else 0
    if not engine.booted:   # a boot still under way is not waited for: its ranks die with this process
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End the process without unwinding the interpreter: a boot thread still in torch's C++ (a build, a
    rendezvous, inductor's workers) would otherwise meet the teardown and abort it. The boot's listener
    directory is removed first (nothing else would)."""
    listener.remove_open_dirs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _layouts(engine_options: dict) -> tuple[str, ...]:
    from phaseflip.engine.config import EngineConfig
    return EngineConfig.from_kwargs(**engine_options).layouts
