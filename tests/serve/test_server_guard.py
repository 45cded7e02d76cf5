"""What guards `phaseflip serve`: the API key (from $PHASEFLIP_API_KEY here), the body-size limit
(refused before the body is parsed), the bounded waiting queue (503 with Retry-After), and /health
answering 503 while the engine boots."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def server(start_server, model):
    server = start_server("--model", model, "--served-model-name", "tiny", "--kv-cache-memory-gib", "0.05",
                          "--max-num-seqs", "1", "--max-waiting", "1", "--max-request-bytes", "4096",
                          env={"PHASEFLIP_API_KEY": KEY}, ready=False)
    r = httpx.get(f"{server.url}/health", timeout=5) if _listening(server) else None
    assert r is None or r.status_code in (200, 503)
    return server.wait_ready()


def _listening(server) -> bool:
    try:
        httpx.get(f"{server.url}/version", timeout=0.5)
        return True
    except httpx.HTTPError:
        return False


def test_health_is_503_while_the_engine_boots(start_server, model):
    booting = start_server("--model", model, "--kv-cache-memory-gib", "0.05", "--compile", "on", ready=False)
    for _ in range(600):
        if _listening(booting):
            break
        asyncio.run(asyncio.sleep(0.05))
    r = httpx.get(f"{booting.url}/health", timeout=5)
    assert r.status_code == 503 and r.json()["status"] == "booting"
    refused = httpx.post(f"{booting.url}/v1/completions", json={"prompt": "hi"}, timeout=5)
    assert refused.status_code == 503 and "booting" in refused.json()["error"]["message"]
    booting.stop()


def test_v1_needs_the_api_key(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").completions.create(model="tiny", prompt="hi", max_tokens=2)
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    ok = server.client(api_key=KEY).completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert ok.usage.completion_tokens >= 1
    assert httpx.get(f"{server.url}/health").status_code == 200     # probes need no key
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_a_body_over_the_limit_is_refused_before_it_is_parsed(server):
    auth = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    r = httpx.post(f"{server.url}/v1/completions", content=b"{" + b"x" * 5000, headers=auth)  # not even JSON
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"

    def chunked():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'
    r = httpx.post(f"{server.url}/v1/completions", content=chunked(), headers=auth)   # no Content-Length
    assert r.status_code == 413
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth)
    assert ok.status_code == 200


def test_a_full_waiting_queue_answers_503_with_retry_after(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "hello", "max_tokens": 100, "ignore_eos": True, "temperature": 0}

    async def burst():
        async with httpx.AsyncClient(timeout=60, headers=auth) as http:
            return await asyncio.gather(*(http.post(f"{server.url}/v1/completions", json=body) for _ in range(6)))

    answers = asyncio.run(burst())        # one runs (max_num_seqs=1), one waits (max_waiting=1)
    full = [r for r in answers if r.status_code == 503]
    assert len(full) >= 4 and all(r.status_code == 200 for r in answers if r not in full)
    assert all(r.headers["Retry-After"] == "1" and "max_waiting=1" in r.json()["error"]["message"] for r in full)
    two = httpx.post(f"{server.url}/v1/completions", json={**body, "n": 2}, headers=auth)   # can never fit:
    assert two.status_code == 400 and two.json()["error"]["param"] == "n"                  # not "retry"
    server.wait_idle()
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth)
    assert ok.status_code == 200


def test_tokenize_and_detokenize_need_the_key_and_answer_as_the_tokenizer_does(server, model):
    from phaseflip.engine.checkpoint.tokenizer import load_tokenizer
    tok, url, auth = load_tokenizer(model), server.url, {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{url}/tokenize", json={"prompt": "hi"}).status_code == 401
    assert httpx.post(f"{url}/detokenize", json={"tokens": [1]}).status_code == 401

    r = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": "The quick brown fox",
                                            "return_token_strs": True}, headers=auth).json()
    assert r["tokens"] == tok.encode("The quick brown fox") and r["count"] == len(r["tokens"])
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"]) and r["max_model_len"] > 0
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    chat = httpx.post(f"{url}/tokenize", json={"messages": messages}, headers=auth).json()
    assert chat["tokens"] == tok.encode_chat(messages)[1] and chat["token_strs"] is None
    back = httpx.post(f"{url}/detokenize", json={"model": "tiny", "tokens": r["tokens"]}, headers=auth).json()
    assert back == {"prompt": "The quick brown fox"}

    for body, param in (({"prompt": "a", "messages": messages}, "messages"), ({}, "prompt"),
                        ({"prompt": 3}, "prompt"), ({"prompt": "a", "tools": []}, "tools"),
                        ({"messages": []}, "messages")):
        bad = httpx.post(f"{url}/tokenize", json=body, headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (body, bad.json())
    for tokens in ([-1], [len(tok)], ["x"]):
        bad = httpx.post(f"{url}/detokenize", json={"tokens": tokens}, headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("tokens"), (tokens, bad.json())
    unknown = httpx.post(f"{url}/tokenize", json={"model": "other", "prompt": "a"}, headers=auth)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
