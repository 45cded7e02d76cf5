"""Logit-level parity with HF transformers on the same weights: every generated token's top-20
logprobs (the engine's raw log-softmax, before any sampling) against HF's log-softmax at those ids, HF
run teacher-forced on the engine's own tokens (so a near-tie that picks the other token compares the
same positions). Tokens alone (test_parity.py) pass an error that keeps the top token; these do not.

fp32: within FP32_TOL nats on the tiny models, SMOLLM_FP32_TOL on SmolLM2's 30 layers (sums in another
order; measured largest differences ~1e-6 and ~7e-5, printed with -s). bf16: the engine in bf16 must be
as close to HF's fp32 answer as HF's own bf16 forward is (its distance, mean and largest, at most
BF16_SLACK times HF bf16's, measured on the same positions): bf16 rounding has no fixed size, but a wrong
operator moves far past it.
"""
import functools

import pytest
import torch

from phaseflip import LLM, SamplingParams
from tests.engine.test_parity import parity_prompts
from tests.models import SMOLLM_TEXTS

TOP = 20
NEW_TOKENS = 12
FP32_TOL = 1e-5          # nats
SMOLLM_FP32_TOL = 5e-4   # nats
BF16_SLACK = 1.25


def engine_logprobs(model_dir, prompts, dtype: str, **engine_kw) -> list[tuple[list[int], list[dict[int, float]]]]:
    """(generated ids, per generated token {id: logprob} of its top TOP) per prompt, greedy."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
    with LLM(model=str(model_dir), dtype=dtype, **engine_kw) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


@functools.lru_cache(maxsize=2)
def hf_model(model_dir: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@pytest.fixture(autouse=True, scope="module")
def _release_hf_models():
    """The HF models (SmolLM2 in fp32 and bf16: ~0.8 GB) are kept for this module's tests only."""
    yield
    hf_model.cache_clear()


def hf_logprobs(model_dir, prompt: list[int], generated: list[int], dtype: torch.dtype) -> torch.Tensor:
    """HF's log-softmax (float32) at each position that predicted a generated token: [len(generated), V]."""
    model = hf_model(str(model_dir), dtype)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + generated]), use_cache=False).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1:-1].float(), dim=-1)


def differences(model_dir, prompts, ours, dtype: torch.dtype, reference=None) -> torch.Tensor:
    """|logprob - HF's| over every generated token's top TOP ids, one flat tensor; `reference`
    (prompt, generated) -> the [len(generated), V] logprobs compared with (default: ours)."""
    out = []
    for prompt, (ids, steps) in zip(prompts, ours):
        ref = hf_logprobs(model_dir, prompt, ids, dtype)
        mine = reference(prompt, ids) if reference else None
        assert len(steps) == len(ids) == NEW_TOKENS
        for j, top in enumerate(steps):
            assert len(top) >= TOP and ids[j] in top, (j, ids[j], sorted(top))
            keys = torch.tensor(list(top.keys()))
            got = torch.tensor(list(top.values())) if mine is None else mine[j, keys]
            out.append((got - ref[j, keys]).abs())
    return torch.cat(out)


def largest_difference(model_dir, prompts, ours, dtype: torch.dtype) -> float:
    return float(differences(model_dir, prompts, ours, dtype).max())


@pytest.mark.parametrize("kind,engine_kw", [
    ("llama", {}),
    ("qwen2", {"max_num_batched_tokens": 16}),     # prompts in 16-token chunks
    ("qwen3", {}),
    ("llama3rope", {}),
    ("gemma2", {}),     # its final soft-cap moves logprobs, never the greedy token
    ("qwen3moe", {}),
])
def test_tiny_models_fp32_logprobs_equal_hf(tiny_model_dir, kind, engine_kw):
    model_dir = tiny_model_dir(kind)
    prompts = parity_prompts(384)
    worst = largest_difference(model_dir, prompts, engine_logprobs(model_dir, prompts, "float32", **engine_kw),
                               torch.float32)
    print(f"\n[logit parity] {kind} fp32: largest difference {worst:.2e} nats")
    assert worst <= FP32_TOL, f"{kind}: a logprob differs from HF's by {worst:.3g} nats (> {FP32_TOL})"


@pytest.fixture(scope="module")
def smollm_prompts(default_model_dir):
    from phaseflip.engine.checkpoint.tokenizer import Tokenizer
    tok = Tokenizer(str(default_model_dir))
    return [tok.encode(t) for t in SMOLLM_TEXTS]


def test_smollm2_fp32_logprobs_equal_hf(default_model_dir, smollm_prompts):
    ours = engine_logprobs(default_model_dir, smollm_prompts, "float32", max_model_len=512)
    worst = largest_difference(default_model_dir, smollm_prompts, ours, torch.float32)
    print(f"\n[logit parity] smollm2 fp32: largest difference {worst:.2e} nats")
    assert worst <= SMOLLM_FP32_TOL, f"smollm2 fp32: a logprob differs from HF's by {worst:.3g} nats"


def test_smollm2_bf16_is_as_close_to_hf_fp32_as_hf_bf16(default_model_dir, smollm_prompts):
    ours = engine_logprobs(default_model_dir, smollm_prompts, "bfloat16", max_model_len=512)
    mine = differences(default_model_dir, smollm_prompts, ours, torch.float32)
    hf_bf16 = differences(default_model_dir, smollm_prompts, ours, torch.float32,
                          reference=lambda p, ids: hf_logprobs(default_model_dir, p, ids, torch.bfloat16))
    print(f"\n[logit parity] smollm2 bf16 against HF fp32: mean {mine.mean():.3f} / largest {mine.max():.3f} "
          f"nats; HF bf16: {hf_bf16.mean():.3f} / {hf_bf16.max():.3f}")
    assert mine.mean() <= BF16_SLACK * hf_bf16.mean(), (float(mine.mean()), float(hf_bf16.mean()))
    assert mine.max() <= BF16_SLACK * hf_bf16.max(), (float(mine.max()), float(hf_bf16.max()))
