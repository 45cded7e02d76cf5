"""A real `phaseflip serve` process on an ephemeral port, for the server's tests.

`Server` starts the command line as a user would (its own session, its log in a file), waits for
/health, and reads /metrics; `descendants` lists every process it started (the rank template and the
ranks the template forked), so a test can check that none outlives it.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

BOOT_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Live processes below pid (by parent links in /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Server:
    def __init__(self, log_dir: Path, *args: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"serve-{self.port}.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "phaseflip.tools.cli", "serve", "--port", str(self.port),
                                      *args], stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})

    def wait_ready(self, timeout_s: float = BOOT_TIMEOUT_S) -> Server:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode} before it was ready:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        pytest.fail(f"the server was not ready within {timeout_s} s:\n{self.output()}")

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def client(self, api_key: str = "none", **options):
        import openai
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **options)

    def async_client(self, api_key: str = "none", **options):
        import openai
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **options)

    def metrics(self) -> dict[str, float]:
        """The unlabelled-by-layout samples of /metrics, by name (labels dropped)."""
        text = httpx.get(f"{self.url}/metrics", timeout=5.0).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out.setdefault(name.split("{", 1)[0], float(value))
        return out

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, float]:
        """Metrics once no sequence runs or waits (the step after an abort frees its blocks)."""
        end = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            idle = m["phaseflip_requests_running"] == 0 and m["phaseflip_requests_waiting"] == 0
            if idle or time.monotonic() > end:
                return m
            time.sleep(0.05)

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def start_server(tmp_path_factory):
    """Factory: start_server(*cli_args) -> a ready Server, stopped at the end of the module."""
    started: list[Server] = []
    log_dir = tmp_path_factory.mktemp("serve-logs")

    def start(*args: str, ready: bool = True, env: dict | None = None) -> Server:
        server = Server(log_dir, *args, env=env)
        started.append(server)
        return server.wait_ready() if ready else server

    yield start
    for server in started:
        server.stop()
