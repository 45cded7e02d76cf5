"""`phaseflip serve` on one rank, driven by the official openai client (and raw HTTP for what the
client hides): answers equal the offline API's, streams arrive whole and in order, a dropped client's
request is aborted and its blocks freed, bad requests are refused naming the field."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from phaseflip import LLM, SamplingParams

ENGINE = ("--kv-cache-memory-gib", "0.05", "--max-model-len", "256")
PROMPTS = ["The quick brown fox", "def fib(n):", "Once upon a time", "1, 2, 3,", "hello world"]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def server(start_server, model):
    return start_server("--model", model, "--served-model-name", "tiny", *ENGINE)


@pytest.fixture(scope="module")
def offline(model):
    with LLM(model, kv_cache_memory_gib=0.05, max_model_len=256) as llm:
        yield llm


def greedy(max_tokens: int, **more) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **more)


def test_greedy_completion_equals_offline_streamed_or_not(server, offline):
    client = server.client()
    want = offline.generate(PROMPTS, greedy(24), use_tqdm=False)
    for prompt, ref in zip(PROMPTS, want):
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        assert whole.choices[0].text == ref.outputs[0].text
        assert whole.choices[0].finish_reason == ref.outputs[0].finish_reason
        assert whole.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert whole.usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert whole.usage.total_tokens == len(ref.prompt_token_ids) + len(ref.outputs[0].token_ids)
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.outputs[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.outputs[0].finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_greedy_chat_equals_offline_chat(server, offline):
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ref = offline.chat(messages, greedy(20), use_tqdm=False)[0]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert whole.choices[0].message.content == ref.outputs[0].text
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert whole.usage.completion_tokens == len(ref.outputs[0].token_ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == ref.outputs[0].finish_reason


def test_token_id_prompts_and_lists_of_prompts(server, offline):
    ids = offline.get_tokenizer().encode("The quick brown fox")
    ref = offline.generate([ids, "hello world"], greedy(8), use_tqdm=False)
    out = server.client().completions.create(model="tiny", prompt=[ids], max_tokens=8, temperature=0)
    assert out.choices[0].text == ref[0].outputs[0].text
    both = server.client().completions.create(model="tiny", prompt=["The quick brown fox", "hello world"],
                                              max_tokens=8, temperature=0, echo=True)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[1].text == "hello world" + ref[1].outputs[0].text
    assert both.usage.prompt_tokens == len(ref[0].prompt_token_ids) + len(ref[1].prompt_token_ids)
    special = offline.get_tokenizer().bos_token_id or 0
    echoed = server.client().completions.create(model="tiny", prompt=[[special] + ids], max_tokens=2,
                                                temperature=0, echo=True, logprobs=1).choices[0]
    lp = echoed.logprobs   # token ids echo with their special tokens: every offset indexes the text
    assert len(lp.tokens) == len(ids) + 3
    # but for the tokens of a character the output's last tokens left incomplete, which it leaves out
    held = [t for o, t in zip(lp.text_offset, lp.tokens) if o >= len(echoed.text)]
    assert all(t == "\ufffd" for t in held), (echoed.text, lp)
    assert all(echoed.text[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens) if o < len(echoed.text)), \
        (echoed.text, lp)


def test_64_concurrent_streams_of_mixed_lengths_arrive_whole_and_in_order(server, offline):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(64)]
    lengths = [4 + (i * 7) % 60 for i in range(64)]
    want = offline.generate(prompts, [greedy(n, ignore_eos=True) for n in lengths], use_tqdm=False)

    async def one(client, prompt, n):
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return [c async for c in stream]

    async def run():
        async with server.async_client(timeout=120) as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

    results = asyncio.run(run())
    for chunks, ref, n in zip(results, want, lengths):
        assert {c.id for c in chunks} == {chunks[0].id}      # one request's chunks, no other's
        assert "".join(c.choices[0].text for c in chunks) == ref.outputs[0].text
        assert chunks[-1].choices[0].finish_reason == "length" and len(ref.outputs[0].token_ids) == n
    assert len({chunks[0].id for chunks in results}) == 64


def test_a_dropped_stream_is_aborted_and_its_blocks_freed(server, offline):
    before = server.wait_idle()
    want = offline.generate(PROMPTS, greedy(40, ignore_eos=True), use_tqdm=False)

    async def dropped():
        body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 240, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
                lines = []
                async for line in response.aiter_lines():
                    lines.append(line)
                    if len(lines) == 6:
                        break
        return lines

    async def kept(client, prompt):
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream])

    async def run():
        async with server.async_client(timeout=60) as client:
            return await asyncio.gather(dropped(), *(kept(client, p) for p in PROMPTS))

    lines, *texts = asyncio.run(run())
    assert any(line.startswith("data: {") for line in lines)
    assert texts == [o.outputs[0].text for o in want]                 # the others are undisturbed
    after = server.wait_idle()
    assert after["phaseflip_requests_aborted_total"] == before["phaseflip_requests_aborted_total"] + 1
    assert after["phaseflip_kv_blocks_free"] == after["phaseflip_kv_blocks_total"]  # nothing leaked
    generated = after["phaseflip_generation_tokens_total"] - before["phaseflip_generation_tokens_total"]
    assert generated < 40 * len(PROMPTS) + 240                        # the dropped one stopped early


def test_a_client_gone_before_its_unstreamed_answer_is_aborted_quietly(server):
    """The client closes its connection once /metrics shows the request running. On a fast machine the
    tiny model's 4 x 240 tokens can all be out before that poll and the close reach the server: such a try
    proves nothing and is made again (at most 3), each one that did not abort having run whole."""
    body = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 240, "n": 4, "temperature": 0,
                       "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    for _ in range(3):
        before = server.wait_idle()
        with socket.create_connection((host, int(port))) as raw:   # closed once the request runs
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            end = time.monotonic() + 30
            while server.metrics()["phaseflip_requests_running"] == 0 and time.monotonic() < end:
                time.sleep(0.005)
        after = server.wait_idle()
        if after["phaseflip_requests_aborted_total"] > before["phaseflip_requests_aborted_total"]:
            break
        generated = after["phaseflip_generation_tokens_total"] - before["phaseflip_generation_tokens_total"]
        assert generated == 4 * 240, "a request neither aborted nor run whole"
    assert after["phaseflip_requests_aborted_total"] == before["phaseflip_requests_aborted_total"] + 1
    assert after["phaseflip_kv_blocks_free"] == after["phaseflip_kv_blocks_total"]
    assert "Exception in ASGI application" not in server.log_path.read_text(errors="replace")


def test_a_default_max_tokens_is_cut_to_the_context_a_named_one_is_refused(server):
    """250 prompt tokens of the 256: completions' default 16 becomes 6; 16 asked for is a 400."""
    out = server.client().completions.create(model="tiny", prompt=[[5] * 250], temperature=0,
                                             extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5] * 250, "max_tokens": 16})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi " * 50}],
                                                                  "max_completion_tokens": 200})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_completion_tokens", chat.text
    cut = server.client().completions.create(model="tiny", prompt=[list(range(5, 305))], max_tokens=4,
                                             temperature=0, extra_body={"truncate_prompt_tokens": 100})
    assert cut.usage.prompt_tokens == 100 and cut.usage.completion_tokens == 4   # 300 tokens, the last 100 kept


@pytest.mark.parametrize("body, status, param", [
    ('{"prompt": "hi", "max_tokens": 4', 400, "body"),                                   # malformed JSON
    ({"prompt": "hi", "max_tokens": "four"}, 400, "max_tokens"),                          # wrong type
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),                              # negative
    ({"prompt": "hi " * 400, "max_tokens": 4}, 400, "prompt"),                            # longer than max_model_len
    ({"prompt": "hi", "max_tokens": 255}, 400, "max_tokens"),                             # prompt + max_tokens too long
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),                                   # unknown model
    ({"prompt": "hi", "best_of": 3}, 400, "best_of"),                                     # not implemented
    ({"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ({"prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),                               # unknown field
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias"),                     # outside the vocabulary
    ({"prompt": [], "max_tokens": 4}, 400, "prompt"),
    ({"prompt": "hi", "n": 100000}, 400, "n"),                                             # can never be queued
    ({"prompt": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
])
def test_bad_completion_requests_are_refused_naming_the_field(server, body, status, param):
    raw = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.url}/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["param"] == param and param.split(".")[0] in error["message"]
    good = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format.type"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ({"messages": []}, "messages"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),     # the engine's logprobs, named as sent
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
])
def test_bad_chat_requests_are_refused_naming_the_field(server, extra, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param.split(".")[0]), r.json()
    assert param.split(".")[0] in r.json()["error"]["message"], r.json()
    assert httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200


def test_n_samples_share_the_prompt_and_equal_the_offline_samples(server, offline):
    prompt = "Once upon a time there was a small village by the sea where"
    want = offline.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12), use_tqdm=False)[0]
    out = server.client().completions.create(model="tiny", prompt=prompt, n=3, temperature=1.0, seed=7,
                                             max_tokens=12)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [o.text for o in want.outputs]
    assert len({c.text for c in out.choices}) > 1                     # seed + i: the samples differ
    assert out.usage.completion_tokens == sum(len(o.token_ids) for o in want.outputs)
    assert out.usage.prompt_tokens == len(want.prompt_token_ids)      # the prompt counted once


def test_n_streamed_samples_each_end_once_with_the_unstreamed_text(server):
    """Samples that stop at different steps: each index's finish_reason comes in one chunk, not again at
    every later step of its siblings; each index's pieces join to the unstreamed text. With vLLM's
    continuous_usage_stats each chunk counts its choice's tokens so far, and the usage chunk them all."""
    body = dict(model="tiny", prompt="Once upon a time there was a small village by the sea where", n=3,
                temperature=1.0, seed=7, max_tokens=24, stop=["e"])
    whole = server.client().completions.create(**body)
    texts, finishes, counts = ["", "", ""], [[], [], []], [[0], [0], [0]]
    chunks = list(server.client().completions.create(
        **body, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    for chunk in chunks[:-1]:
        assert len(chunk.choices) == 1   # one choice a chunk, as OpenAI sends them
        c = chunk.choices[0]
        texts[c.index] += c.text
        if c.finish_reason is not None:
            finishes[c.index].append(c.finish_reason)
        assert chunk.usage.prompt_tokens == whole.usage.prompt_tokens
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        counts[c.index].append(chunk.usage.completion_tokens)
    assert texts == [c.text for c in whole.choices]
    assert finishes == [[c.finish_reason] for c in whole.choices]
    assert all(a < b for each in counts for a, b in zip(each, each[1:]))   # each chunk brings tokens
    assert sum(each[-1] for each in counts) == whole.usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert len({len(c.text) for c in whole.choices}) > 1, "the samples were meant to end at different steps"


def test_logit_bias_and_penalties_reach_the_sampler(server, offline):
    client = server.client()
    plain = offline.generate("1, 2, 3,", greedy(16), use_tqdm=False)[0].outputs[0]
    first = plain.token_ids[0]
    biased = client.completions.create(model="tiny", prompt="1, 2, 3,", max_tokens=16, temperature=0,
                                       logit_bias={str(first): -100})
    want = offline.generate("1, 2, 3,", greedy(16, logit_bias={first: -100}), use_tqdm=False)[0].outputs[0]
    assert biased.choices[0].text == want.text != plain.text and first not in want.token_ids
    for penalty in ({"frequency_penalty": 1.5}, {"presence_penalty": 1.5}, {"repetition_penalty": 1.5}):
        penalized = client.completions.create(model="tiny", prompt="1, 2, 3,", max_tokens=16, temperature=0,
                                              extra_body=penalty)
        want = offline.generate("1, 2, 3,", greedy(16, **penalty), use_tqdm=False)[0].outputs[0]
        assert penalized.choices[0].text == want.text != plain.text, penalty
    tok = offline.get_tokenizer()   # a word of the output that is one whole token of it
    said, word = next((t, tok.decode([t])) for t in plain.token_ids
                      if tok.encode(tok.decode([t]).lstrip(), add_special_tokens=False) == [t])
    unsaid = client.completions.create(model="tiny", prompt="1, 2, 3,", max_tokens=16, temperature=0,
                                       extra_body={"bad_words": [word]})
    want = offline.generate("1, 2, 3,", greedy(16, bad_words=[word]), use_tqdm=False)[0].outputs[0]
    assert unsaid.choices[0].text == want.text != plain.text and said not in want.token_ids


def test_logprobs_in_completions_and_chat(server):
    out = server.client().completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) >= 3 and max(top.values()) <= 0 for top in lp.top_logprobs)
    assert "".join(lp.tokens).startswith(out.choices[0].text[:1])
    chat = server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_echo_with_logprobs_scores_the_prompt_as_the_offline_engine_does(server, offline):
    prompt = "The quick brown fox jumps"
    ids = offline.get_tokenizer().encode(prompt)
    ref = offline.generate([prompt], greedy(3, logprobs=1, prompt_logprobs=1), use_tqdm=False)[0]
    want = [None] + [ref.prompt_logprobs[i][ids[i]] for i in range(1, len(ids))]
    want += [d[t] for d, t in zip(ref.outputs[0].logprobs, ref.outputs[0].token_ids)]
    whole = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0,
                                               logprobs=1, echo=True)
    chunks = list(server.client().completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0,
                                                     logprobs=1, echo=True, stream=True))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    for got in (whole.choices[0].logprobs.token_logprobs, streamed):
        assert len(got) == len(ids) + 3 and got[0] is None
        assert got[1:] == pytest.approx(want[1:], abs=1e-4)
    assert whole.choices[0].text == prompt + ref.outputs[0].text
    assert whole.choices[0].logprobs.top_logprobs[0] is None
    # max_tokens=0 with echo: the prompt and its logprobs alone (how loglikelihood scorers call it)
    only = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=0, logprobs=1, echo=True)
    assert only.choices[0].text == prompt and only.choices[0].finish_reason == "length"
    assert only.choices[0].logprobs.token_logprobs[1:] == pytest.approx(want[1:len(ids)], abs=1e-4)
    assert len(only.choices[0].logprobs.tokens) == len(ids)
    assert (only.usage.prompt_tokens, only.usage.completion_tokens) == (len(ids), 0)
    streamed = list(server.client().completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True,
                                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == prompt
    assert streamed[-1].usage.completion_tokens == 0
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 0})   # without echo
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_models_health_version_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    m = server.metrics()
    for name in ("phaseflip_requests_running", "phaseflip_requests_waiting", "phaseflip_kv_blocks_used",
                 "phaseflip_kv_blocks_free", "phaseflip_prefix_cache_hit_rate", "phaseflip_active_layout",
                 "phaseflip_time_to_first_token_seconds_count", "phaseflip_inter_token_latency_seconds_count",
                 "phaseflip_prompt_tokens_total", "phaseflip_generation_tokens_total"):
        assert name in m, name
    assert m["phaseflip_time_to_first_token_seconds_count"] > 0 and m["phaseflip_generation_tokens_total"] > 0
