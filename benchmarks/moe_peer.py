"""phaseflip against llama.cpp on a mixture of experts (a benchmark, not a test; `make test` never runs it).

Owns: issue 46's MoE speed rows. Builds a random-weight Qwen3-MoE with transformers (SmolLM2's tokenizer
and hidden size, 16 experts, top-4, renormalised; --experts/--top-k/--layers change it), converts it with
llama.cpp's own converter (f32 and bf16 GGUF, cached in --work-dir), and runs gguf_peer's workloads
interleaved: phaseflip serving the safetensors checkpoint, llama.cpp the GGUF converted from it, the same
weights (llama-batched-bench's 200 + 100 at batch 1 and 32, llama-bench's tg128 and pp512, and the read
bound of a decode token: the active experts' bytes, top_k / num_experts of them, plus the rest).
Run: `.venv/bin/python benchmarks/moe_peer.py --llama-bench BIN --llama-batched-bench BIN`
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import click

from gguf_peer import boot, decode_bytes, one_round, print_table, summarise
from llamacpp_peer import EXE, _find_converter, _log, ensure_ggufs
from phaseflip.engine.checkpoint.default_model import default_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def make_moe(out: Path, experts: int, top_k: int, layers: int, seed: int = 0) -> Path:
    """A Qwen3-MoE of random weights (std 0.02, norms 1) shaped like SmolLM2-135M's attention, with its
    tokenizer; kept when it exists already."""
    if (out / "model.safetensors").is_file():
        return out
    import torch
    import transformers
    src = Path(default_model_dir())
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, moe_intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, num_experts=experts, num_experts_per_tok=top_k,
        norm_topk_prob=True, max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        rope_parameters=dict(rope_type="default", rope_theta=100000.0))
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.02)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, out / name)
    return out


@click.command()
@click.option("--llama-bench", required=True, type=EXE, help="llama.cpp's built llama-bench.")
@click.option("--llama-batched-bench", required=True, type=EXE, help="llama.cpp's built llama-batched-bench.")
@click.option("--convert-python", type=EXE, default=sys.executable, show_default=True,
              help="The interpreter that runs llama.cpp's converter (needs torch, numpy, transformers, sentencepiece).")
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("/tmp/phaseflip-moe"),
              show_default=True, help="Where the model and its GGUFs are kept.")
@click.option("--experts", type=click.IntRange(min=2), default=16, show_default=True)
@click.option("--top-k", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--layers", type=click.IntRange(min=1), default=12, show_default=True)
@click.option("--outtype", type=click.Choice(["f32", "bf16"]), multiple=True, default=("f32",), show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the tables.")
def main(llama_bench, llama_batched_bench, convert_python, work_dir, experts, top_k, layers, outtype, threads,
         rounds, repeats, as_json):
    """Benchmark phaseflip against llama.cpp on the same random MoE, interleaved, and print the ratios."""
    model = make_moe(work_dir / f"qwen3moe-e{experts}-k{top_k}-l{layers}", experts, top_k, layers)
    ggufs = ensure_ggufs(model, work_dir, _find_converter(llama_bench), str(convert_python))
    o = {"llama_bench": llama_bench, "llama_batched_bench": llama_batched_bench, "threads": threads,
         "repeats": repeats}
    results = {}
    for out in outtype:
        llm = boot(model, threads, dtype="float32" if out == "f32" else "bfloat16")
        try:
            nbytes = decode_bytes(llm)
            got = []
            for i in range(rounds):
                _log(f"{model.name} {out}: round {i + 1}/{rounds}")
                got.append(one_round(llm, ggufs[out], o))
        finally:
            llm.shutdown()
        results[out] = summarise(got, nbytes)
        if not as_json:
            print_table(f"{model.name} {out}", results[out], threads)
    if as_json:
        click.echo(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
