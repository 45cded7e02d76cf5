"""How far phaseflip's bf16 greedy tokens agree with HF transformers' (a measurement, not a test).

Owns: greedy decoding of a few prompts with phaseflip bf16, HF bf16 and HF fp32 on the same weights
(default: the embedded SmolLM2-135M-Instruct) and printing, per pair, how many sequences are identical
and where each first diverges. bf16 rounds differently in every implementation (accumulation order), so
the yardstick is HF bf16 against HF fp32: phaseflip bf16 agreeing with HF as well as HF bf16 agrees with
itself in fp32 is "as far as bf16 allows". Usage: `.venv/bin/python benchmarks/bf16_agreement.py`.
"""
from __future__ import annotations

import click
import torch

from phaseflip.engine.llm import LLM
from phaseflip.engine.sampling_params import SamplingParams

TEXTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
         "1, 2, 3, 4,", "The quick brown fox", "Water boils at", "A short poem about the moon:\n",
         "Photosynthesis is the process " * 12)


def _hf_greedy(model_dir: str, dtype: torch.dtype, prompts: list[list[int]], new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False)[0, len(p):].tolist() for p in prompts]


def _first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@click.command()
@click.option("--model", default=None, help="HF-format model directory (default: the embedded SmolLM2).")
@click.option("--new-tokens", type=click.IntRange(min=1), default=32, show_default=True)
def main(model, new_tokens):
    from phaseflip.engine.checkpoint.default_model import ensure_default_model
    from phaseflip.engine.checkpoint.tokenizer import load_tokenizer
    model_dir = str(model or ensure_default_model())
    prompts = [load_tokenizer(model_dir).encode(t) for t in TEXTS]
    with LLM(model=model_dir, dtype="bfloat16") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    runs = {"phaseflip bf16": [o.outputs[0].token_ids for o in outs],
            "HF bf16": _hf_greedy(model_dir, torch.bfloat16, prompts, new_tokens),
            "HF fp32": _hf_greedy(model_dir, torch.float32, prompts, new_tokens)}
    for a, b in (("phaseflip bf16", "HF bf16"), ("phaseflip bf16", "HF fp32"), ("HF bf16", "HF fp32")):
        first = [_first_divergence(x, y) for x, y in zip(runs[a], runs[b])]
        same = sum(x == y for x, y in zip(runs[a], runs[b]))
        click.echo(f"{a} vs {b}: identical {same}/{len(prompts)}; first divergence at {first} "
                   f"(of {new_tokens} tokens)")


if __name__ == "__main__":
    main()
