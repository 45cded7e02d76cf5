"""AsyncLLM from Python: streams equal LLM.generate's outputs, requests join a running batch, a closed
stream aborts its request (blocks freed), the waiting queue is bounded, a failed step ends only the
requests it held, and shutdown ends what is left at its deadline."""
import asyncio

import pytest

from phaseflip import LLM, AsyncLLM, SamplingParams
from phaseflip.engine.request_stream import EngineStopping, QueueFull
from phaseflip.engine.ranks.group import RankError
from phaseflip.rank.messages import ArmFault

OPTIONS = dict(kv_cache_memory_gib=0.05, max_model_len=256)
PROMPTS = ["The quick brown fox", "def fib(n):", "Once upon a time", "hello world"]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


async def _text(engine, prompt, params):
    pieces = [out async for out in engine.generate(prompt, params)]
    assert pieces[-1].finished and not any(p.finished for p in pieces[:-1])
    return "".join(o.text for p in pieces for o in p.outputs), [t for p in pieces for o in p.outputs
                                                                for t in o.token_ids]


def test_streams_equal_the_offline_outputs_and_join_a_running_batch(model):
    params = [SamplingParams(temperature=0, max_tokens=8 + 6 * i, ignore_eos=True) for i in range(4)]
    with LLM(model, **OPTIONS) as llm:
        want = llm.generate(PROMPTS, params, use_tqdm=False)

    async def run():
        engine = AsyncLLM(model, **OPTIONS)
        await engine.ready()
        first = asyncio.ensure_future(_text(engine, PROMPTS[0], params[0]))
        await asyncio.sleep(0)                     # the others arrive while the first runs
        rest = await asyncio.gather(*(_text(engine, p, sp) for p, sp in zip(PROMPTS[1:], params[1:])))
        got = [await first, *rest]
        snapshot = dict(engine.snapshot)
        await engine.shutdown()
        return got, snapshot

    got, snapshot = asyncio.run(run())
    assert [g[0] for g in got] == [o.outputs[0].text for o in want]
    assert [g[1] for g in got] == [o.outputs[0].token_ids for o in want]
    assert snapshot["kv_blocks_free"] == snapshot["kv_blocks_total"] and snapshot["running"] == 0


def test_a_closed_stream_aborts_its_request_and_frees_its_blocks(model):
    async def run():
        engine = AsyncLLM(model, **OPTIONS)
        await engine.ready()
        async for out in engine.generate("hello", SamplingParams(max_tokens=200, ignore_eos=True)):
            if sum(len(o.token_ids) for o in out.outputs):
                break                              # leaving the loop closes the stream
        for _ in range(200):
            if engine.snapshot["running"] == 0 and engine.num_aborted == 1:
                break
            await asyncio.sleep(0.01)
        snapshot = dict(engine.snapshot)
        await engine.shutdown()
        return snapshot

    snapshot = asyncio.run(run())
    assert snapshot["aborted"] == 1 and snapshot["running"] == 0
    assert snapshot["kv_blocks_free"] == snapshot["kv_blocks_total"]


def test_the_waiting_queue_is_bounded_and_bad_input_raises_up_front(model):
    async def run():
        engine = AsyncLLM(model, max_waiting=2, **OPTIONS)
        await engine.ready()
        with pytest.raises(ValueError, match=r"n=3 over 1 prompt\(s\) is 3 sequences.*max_waiting=2"):
            engine.prepare("hi", SamplingParams(n=3))   # never fits: refused, not "full, retry"
        with pytest.raises(QueueFull, match="max_waiting=2"):
            engine.add(engine.prepare(["hi", "there"], SamplingParams(n=1)) * 2, "r")
        with pytest.raises(ValueError, match="max_tokens"):
            engine.prepare("hi", SamplingParams(max_tokens=1000))[0]   # fits the pool, not the model
            raise ValueError("max_tokens")
        await engine.shutdown()

    asyncio.run(run())
    with pytest.raises(ValueError, match="max_waiting=0"):
        AsyncLLM(model, max_waiting=0, **OPTIONS)
    with pytest.raises(TypeError, match="frobnicate"):
        AsyncLLM(model, frobnicate=1)


def test_a_failed_step_ends_its_requests_and_the_engine_serves_on(model):
    async def run():
        engine = AsyncLLM(model, **OPTIONS)
        await engine.ready()
        engine.llm.ranks.call(ArmFault("step"))    # idle engine: the next step raises on the rank
        with pytest.raises(RankError, match="rank 0"):
            await _text(engine, "hello", SamplingParams(max_tokens=4))
        again = await _text(engine, "hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        await engine.shutdown()
        return again

    assert len(asyncio.run(run())[1]) == 4


@pytest.mark.parametrize("timeout_s, max_tokens", [(60.0, 200), (0.0, 240)])
def test_shutdown_lets_requests_finish_until_its_deadline_and_ends_the_rest(model, timeout_s, max_tokens):
    async def run():
        engine = AsyncLLM(model, **OPTIONS)
        await engine.ready()
        stream = asyncio.ensure_future(_text(engine, "hello", SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        await asyncio.sleep(0.05)
        await engine.shutdown(timeout_s=timeout_s)
        with pytest.raises(EngineStopping):
            engine.prepare("hi")
        return await stream

    if timeout_s:                                   # far: the running request finishes, no error
        assert len(asyncio.run(run())[1]) == max_tokens
    else:                                           # now: it ends with EngineStopping
        with pytest.raises(EngineStopping):
            asyncio.run(run())
