"""The HuggingFace transformers side of `phaseflip bench`, run in its own process.

Owns: timing HF `generate` on a workload file with its best offline configuration (prompts sorted by
length, batched, left padding; greedy; EOS off so every request gets exactly its max_tokens) and the
single-stream figures (time to first token, ms per output token at batch 1). Usage:
    python -m phaseflip.tools.bench_hf MODEL_DIR WORKLOAD.json --threads N --batch-size B
prints one JSON object on stdout. Only the benchmark imports transformers; the engine never does.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from phaseflip.tools import bench_single


def _load(model_dir: str):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run every request to its max_tokens, as the engine does
    return model


def _generate(model, rows: list[list[int]], new_tokens: int, pad_id: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
    return out[:, width:]


def offline(model, prompts: list[list[int]], max_tokens: list[int], batch_size: int, pad_id: int) -> dict:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        gen = _generate(model, [prompts[i] for i in idx], max(max_tokens[i] for i in idx), pad_id)
        for row, i in enumerate(idx):
            outputs[i] = gen[row, :max_tokens[i]].tolist()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "output_tokens": sum(max_tokens),
            "tokens_per_s": sum(max_tokens) / seconds, "batch_size": batch_size,
            "token_ids": [outputs[i] for i in range(len(prompts))]}


def single_stream(model, prompt: list[int], max_tokens: int, pad_id: int, repeats: int = 3) -> dict:
    def timed(n: int) -> float:
        t0 = time.perf_counter()
        _generate(model, [prompt], n, pad_id)
        return time.perf_counter() - t0
    return bench_single.single_stream(timed, max_tokens, repeats)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("workload")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with open(args.workload, encoding="utf-8") as f:
        work = json.load(f)
    model = _load(args.model_dir)
    pad_id = work["pad_id"]
    first = (work.get("single") or work["offline"])["prompts"][0]
    _generate(model, [first[:16]], 4, pad_id)  # warm-up
    result = {"threads": torch.get_num_threads(), "transformers": __import__("transformers").__version__}
    if work.get("single"):
        s = work["single"]
        result["single"] = single_stream(model, s["prompts"][0], s["max_tokens"][0], pad_id)
    if work.get("offline"):
        o = work["offline"]
        result["offline"] = offline(model, o["prompts"], o["max_tokens"], args.batch_size, pad_id)
    json.dump(result, __import__("sys").stdout)


if __name__ == "__main__":
    main()
