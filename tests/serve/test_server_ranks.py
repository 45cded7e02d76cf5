"""`phaseflip serve` over two ranks: the layouts flip while requests stream (forced every step here)
and the answers equal one rank's offline answers; SIGTERM during 16 streams ends them within the
shutdown timeout and leaves no process behind, and SIGTERM while booting ends the boot the same way; a rank that dies ends the streams with an error event
and the server exits non-zero."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from phaseflip import LLM, SamplingParams
from tests.reliability.support import wait_gone
from tests.serve.conftest import descendants

ENGINE = ("--kv-cache-memory-gib", "0.05", "--max-model-len", "256", "--world-size", "2", "--layouts", "pp,tp")


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


async def _stream_texts(server, prompts, lengths):
    async def one(client, prompt, n):
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream])
    async with server.async_client(timeout=120) as client:
        return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))


def test_two_ranks_flipping_every_step_serve_one_rank_offline_answers(start_server, model):
    server = start_server("--model", model, "--served-model-name", "tiny", *ENGINE, "--flip-every-steps", "1")
    prompts = [f"Once upon a time {i}" for i in range(8)]
    lengths = [6 + 5 * i for i in range(8)]
    with LLM(model, kv_cache_memory_gib=0.05, max_model_len=256) as llm:
        want = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths],
                            use_tqdm=False)
    assert asyncio.run(_stream_texts(server, prompts, lengths)) == [o.outputs[0].text for o in want]
    metrics = httpx.get(f"{server.url}/metrics").text
    flips = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("phaseflip_flips_total{") and 'ok="true"' in line)
    assert flips >= 10


def test_sigterm_during_16_streams_ends_them_in_time_and_leaves_no_process(start_server, model):
    server = start_server("--model", model, "--served-model-name", "tiny", *ENGINE, "--shutdown-timeout", "0.5")
    procs = descendants(server.proc.pid)
    assert len(procs) >= 2          # the rank template and the ranks it forked
    body = {"model": "tiny", "max_tokens": 240, "ignore_eos": True, "stream": True, "temperature": 0}

    async def run():
        async def one(http, i):
            lines = []
            async with http.stream("POST", f"{server.url}/v1/completions", json={**body, "prompt": f"story {i}"}) as r:
                async for line in r.aiter_lines():
                    if line:
                        lines.append(line)
                    if len(lines) == 1:
                        started.append(i)
            return lines
        started: list[int] = []
        async with httpx.AsyncClient(timeout=60) as http:
            tasks = [asyncio.ensure_future(one(http, i)) for i in range(16)]
            while len(started) < 16:
                await asyncio.sleep(0.02)
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks)
        return results, t0

    results, t0 = asyncio.run(run())
    server.proc.wait(30)
    took = time.monotonic() - t0
    assert server.proc.returncode == 0, server.output()
    assert took < 0.5 + 8, f"the server took {took:.1f} s to exit with --shutdown-timeout 0.5"
    for lines in results:
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][len("data: "):])
        assert "error" in last or last["choices"][0]["finish_reason"] == "length"
    assert any("error" in json.loads(lines[-2][6:]) for lines in results)   # cut at the deadline (240
    # tokens each take 16 streams ~3 s over two ranks here: 0.5 s cannot finish them)
    assert wait_gone(procs, 10.0) == [], "processes outlived the server by 10 s"


def test_sigterm_while_booting_exits_cleanly_and_leaves_no_process(start_server, model, tmp_path):
    """A signal before the engine is up: /health answered 503 (booting), the server exits 0 promptly without
    waiting for the boot (nor aborting in its teardown), its ranks die with it, and the directory of the
    socket they connect back to is gone."""
    server = start_server("--model", model, "--served-model-name", "tiny", *ENGINE, ready=False,
                          env={"TMPDIR": str(tmp_path)})
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 503:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    procs = descendants(server.proc.pid)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(30)
    assert server.proc.returncode == 0, server.output()
    assert time.monotonic() - t0 < 10, server.output()
    assert "failed to boot" not in server.output()
    assert wait_gone(procs, 10.0) == [], "processes outlived the server by 10 s"
    assert list(tmp_path.glob("phaseflip-ranks-*")) == [], "the ranks' socket directory outlived the server"


def test_a_dead_rank_ends_the_streams_with_an_error_and_the_server_exits_non_zero(start_server, model):
    server = start_server("--model", model, "--served-model-name", "tiny", *ENGINE)
    procs = descendants(server.proc.pid)
    ranks = [p for p in procs if p not in {c for c in procs if _parent(c) == server.proc.pid}]
    body = {"model": "tiny", "max_tokens": 240, "ignore_eos": True, "stream": True, "temperature": 0}

    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            async def one(i):
                lines = []
                async with http.stream("POST", f"{server.url}/v1/completions", json={**body, "prompt": f"x {i}"}) as r:
                    async for line in r.aiter_lines():
                        if line:
                            lines.append(line)
                            if len(lines) == 2 and i == 0:
                                os.kill(ranks[-1], signal.SIGKILL)
                return lines
            return await asyncio.gather(*(one(i) for i in range(4)))

    results = asyncio.run(run())
    for lines in results:
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert error["code"] == 503 and "dead" in error["message"]
    try:
        assert httpx.get(f"{server.url}/health", timeout=2).status_code == 503
    except httpx.HTTPError:
        pass                                     # already gone: it exits at once
    assert server.proc.wait(30) == 1, server.output()
    assert wait_gone(procs, 10.0) == [], "processes outlived the server by 10 s"


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])
