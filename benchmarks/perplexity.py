"""Perplexity of GGUF files, phaseflip against llama.cpp's `llama-perplexity` on the same file and text,
and HF transformers on a model directory (a benchmark, not a test; its numbers are for the closing note).

Owns: the text (Python's own reference-manual topics, `pydoc_data.topics`, joined in key order and cut
to --chars characters: deterministic for a Python version, nothing to download), llama-perplexity's
protocol repeated (the text tokenised whole; chunks of --ctx tokens, each starting with BOS where the
tokenizer adds one; in each chunk the tokens after its first half scored, each given every token
before it in the chunk; perplexity = exp(mean negative logprob)), phaseflip's side through
SamplingParams.prompt_logprobs, HF's through its logits, and llama-perplexity's "Final estimate".
Prints one JSON line per file: both perplexities, the chunks each scored, and phaseflip / llama.cpp - 1.
With --llama-tokenize, phaseflip and HF score llama.cpp's own token ids of the text (`llama-tokenize
--ids`), so that the comparison is of the models' arithmetic alone: llama.cpp's pre-tokenizer for some
models (SmolLM2's "smollm") splits runs of spaces and digits unlike the HF tokenizer the model ships.
Run: `.venv/bin/python benchmarks/perplexity.py --llama-perplexity BIN [--llama-tokenize BIN] [--hf-dir DIR]
[--dtype bfloat16] FILE.gguf...`
"""
from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import tempfile
import time
from pathlib import Path


def text(chars: int) -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics))[:chars]


def chunks(ids: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: whole ctx-token windows, the first token replaced by BOS where the
    tokenizer adds one."""
    out = [ids[i * ctx:(i + 1) * ctx] for i in range(len(ids) // ctx)]
    return [[bos, *c[1:]] if bos is not None else c for c in out]


def scored_nll(logprob_of, chunk: list[int]) -> list[float]:
    """The negative logprobs of chunk[first + 1:], first = len(chunk) // 2; logprob_of(j) is that of
    chunk[j] given chunk[:j]."""
    first = len(chunk) // 2
    return [-logprob_of(j) for j in range(first + 1, len(chunk))]


def llama_ids(binary: str, model: str, body: str) -> list[int]:
    """llama.cpp's token ids of the text, BOS included where its vocabulary adds one."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(body)
        f.flush()
        run = subprocess.run([binary, "-m", model, "-f", f.name, "--ids", "--log-disable"], capture_output=True,
                             text=True, check=True)
    return json.loads(run.stdout.strip())


def phaseflip_ppl(model: str, body: str, ctx: int, threads: int, given: list[int] | None = None,
                  dtype: str = "auto", block_products: str = "auto") -> dict:
    """given: the token ids to score (llama.cpp's), else the text tokenised by the model's tokenizer."""
    from phaseflip import LLM, SamplingParams
    t0 = time.perf_counter()
    with LLM(model, num_threads=threads, max_model_len=ctx + 8, max_num_seqs=1, dtype=dtype,
             block_products=block_products) as llm:
        tok = llm.get_tokenizer()
        ids = given if given is not None else tok.encode(body, add_special_tokens=False)
        bos = tok.bos_token_id if tok.encode("a")[:1] == [tok.bos_token_id] else None
        parts = chunks(ids, ctx, bos)
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        nll: list[float] = []
        for part in parts:
            out = llm.generate([{"prompt_token_ids": part}], params, use_tqdm=False)[0]
            nll += scored_nll(lambda j: out.prompt_logprobs[j][part[j]], part)
    return {"ppl": math.exp(sum(nll) / len(nll)), "tokens": len(ids), "chunks": len(parts), "scored": len(nll),
            "seconds": round(time.perf_counter() - t0, 1)}


def hf_ppl(model_dir: str, body: str, ctx: int, threads: int, given: list[int] | None = None) -> dict:
    import torch
    import transformers
    torch.set_num_threads(threads)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = given if given is not None else tok.encode(body, add_special_tokens=False)
    bos = tok.bos_token_id if tok.encode("a")[:1] == [tok.bos_token_id] else None
    parts, nll = chunks(ids, ctx, bos), []
    with torch.no_grad():
        for part in parts:
            logp = hf(torch.tensor([part])).logits[0].float().log_softmax(-1)
            nll += scored_nll(lambda j: logp[j - 1, part[j]].item(), part)
    return {"ppl": math.exp(sum(nll) / len(nll)), "tokens": len(ids), "chunks": len(parts), "scored": len(nll)}


def llama_ppl(binary: str, model: str, body: str, ctx: int, threads: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(body)
        f.flush()
        run = subprocess.run([binary, "-m", model, "-f", f.name, "-c", str(ctx), "-b", str(ctx), "-t", str(threads)],
                             capture_output=True, text=True, check=True)
    log = run.stdout + run.stderr
    final = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", log)
    over = re.search(r"calculating perplexity over (\d+) chunks", log)
    return {"ppl": float(final.group(1)), "error": float(final.group(2)), "chunks": int(over.group(1)) if over else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="GGUF files")
    ap.add_argument("--llama-perplexity", required=True, help="llama.cpp's llama-perplexity binary")
    ap.add_argument("--llama-tokenize", help="llama.cpp's llama-tokenize: every side scores its token ids")
    ap.add_argument("--hf-dir", help="also HF transformers on this model directory")
    ap.add_argument("--chars", type=int, default=100_000, help="characters of the text (default ~22k tokens)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="phaseflip's activations: auto (float32 on the CPU), bfloat16")
    ap.add_argument("--block-products", default="auto", choices=("auto", "int8", "exact"),
                    help="phaseflip's products on blocks: x rounded to int8 per block, or as it is")
    a = ap.parse_args()
    body = text(a.chars)
    ids = {path: llama_ids(a.llama_tokenize, path, body) if a.llama_tokenize else None for path in a.files}
    if a.hf_dir:
        print(json.dumps({"hf": a.hf_dir, **hf_ppl(a.hf_dir, body, a.ctx, a.threads, ids[a.files[0]])}), flush=True)
    for path in a.files:
        ours = phaseflip_ppl(path, body, a.ctx, a.threads, ids[path], a.dtype, a.block_products)
        theirs = llama_ppl(a.llama_perplexity, path, body, a.ctx, a.threads)
        print(json.dumps({"file": Path(path).name, "phaseflip": ours, "llama.cpp": theirs,
                          "phaseflip_over_llama": round(ours["ppl"] / theirs["ppl"] - 1, 5)}), flush=True)


if __name__ == "__main__":
    main()
