"""Capacity: what can never fit is refused up front naming the numbers, boot refuses
a KV budget that cannot serve max_model_len once (and its advice works), and preemption under
pressure (recompute) keeps greedy outputs identical to an unpressured single-rank run."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from phaseflip import LLM
from tests.reliability.support import ENGINE, MAX_MODEL_LEN, assert_settled, deadline, greedy, ids

BLOCK = 16


def block_bytes(model: str) -> int:
    """Bytes of one KV block of the whole model (one rank holds every layer and head), fp32."""
    c = json.loads((Path(model) / "config.json").read_text())
    return c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 2 * 4 * BLOCK


def test_boot_refuses_a_kv_budget_that_cannot_hold_max_model_len_and_its_advice_works(model):
    per_block = block_bytes(model)
    three_blocks_gib = 3.5 * per_block / 2**30
    with pytest.raises(ValueError) as info:
        LLM(model=model, **ENGINE, kv_cache_memory_gib=three_blocks_gib)
    msg = str(info.value)
    assert f"max_model_len={MAX_MODEL_LEN} tokens: it needs {MAX_MODEL_LEN // BLOCK} blocks of {BLOCK} tokens" in msg
    assert f"({per_block} bytes per block" in msg and "holds 3 blocks (48 tokens)" in msg, msg
    assert "lower max_model_len to <= 48" in msg, msg
    raise_to = float(msg.split("raise kv_cache_memory_gib to >= ")[1].split(",")[0])
    # The advice works either way: the quoted budget boots, and so does the quoted length.
    with LLM(model=model, **ENGINE, kv_cache_memory_gib=raise_to) as llm:
        assert llm.stats()["num_kv_blocks"] >= MAX_MODEL_LEN // BLOCK
    with LLM(model=model, **{**ENGINE, "max_model_len": 48}, kv_cache_memory_gib=three_blocks_gib) as llm:
        assert llm.stats()["num_kv_blocks"] == 3


def test_boot_names_the_models_maximum_when_max_model_len_was_not_given(model):
    engine = {k: v for k, v in ENGINE.items() if k != "max_model_len"}
    with pytest.raises(ValueError, match=r"max_model_len=256 \(the model's maximum: max_model_len was not "
                                         r"given\) tokens: it needs 16 blocks .* holds 0 blocks \(0 tokens\): "
                                         r"raise kv_cache_memory_gib to >= [0-9.e-]+$"):
        LLM(model=model, **engine, kv_cache_memory_gib=1e-9)


def test_a_request_that_can_never_fit_is_refused_up_front_and_blocks_nothing(model, reference):
    """A 4-block pool (64 tokens) under max_model_len=128: a 70-token prompt can never run."""
    ok = [[5, 6, 7], [40 + i for i in range(20)]]
    with LLM(model=model, **ENGINE, num_kv_blocks=4) as llm, deadline(60, "the small-pool engine"):
        steps = llm.stats()["steps"]
        with pytest.raises(ValueError, match=r"prompt 1 has 70 tokens, but the KV pool holds only 64 tokens"):
            llm.generate([ok[0], [9] * 70, ok[1]], greedy(8), use_tqdm=False)
        assert llm.stats()["steps"] == steps, "a request ran although its batch was refused"
        assert_settled(llm)
        assert ids(llm.generate(ok, greedy(8), use_tqdm=False)) == reference(ok, 8)
        # 50 + 40 tokens outgrow the pool: that request ends at the pool ("length") and the two
        # others, which share its pool and its steps, still complete with the reference tokens.
        long = [3 + i % 50 for i in range(50)]
        outs = llm.generate([ok[0], long, ok[1]], greedy(40), use_tqdm=False)
        assert_settled(llm)
    assert [ids(outs)[0], ids(outs)[2]] == reference(ok, 40)
    cut = outs[1].outputs[0]
    # The pool holds 64 tokens' KV; the token sampled from the 64th needs none: 65 in all.
    assert cut.finish_reason == "length" and len(long) + len(cut.token_ids) == 64 + 1
    assert cut.token_ids == reference([long], 40)[0][:len(cut.token_ids)]


@pytest.mark.parametrize("world_size", [1, 2])
def test_preemption_under_pressure_keeps_greedy_outputs(model, reference, world_size):
    """8 blocks (128 tokens) for 8 requests of up to 84 tokens: recompute preemption, on 2 ranks
    with a flip every 2 steps carrying the live KV; tokens equal an unpressured single-rank run."""
    rng = random.Random(world_size)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randrange(4, 60))] for _ in range(8)]
    extra = dict(world_size=2, flip_every_steps=2) if world_size == 2 else {}
    with LLM(model=model, **ENGINE, num_kv_blocks=8, **extra) as llm, deadline(120, "the pressured engine"):
        outs = llm.generate(prompts, greedy(24), use_tqdm=False)
        stats = assert_settled(llm)
    assert stats["num_preemptions"] > 0, "the 8-block pool was meant to force preemption"
    assert world_size == 1 or stats["flips"] > 0
    assert ids(outs) == reference(prompts, 24)
    assert sum(o.metrics.num_preemptions for o in outs) == stats["num_preemptions"]
