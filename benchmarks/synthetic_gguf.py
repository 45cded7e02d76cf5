"""A llama GGUF of a larger shape with random weights, for the read bound where weights dominate (a benchmark
tool, not a test; `make test` never runs it).

Owns: writing FILE.gguf of a llama shape (default SmolLM2-1.7B's: hidden 2048, 24 layers, 32 query and 32
key/value heads of 64, MLP 8192, tied embedding) whose metadata, tokenizer and chat template are copied from
a small GGUF (default: the embedded SmolLM2-135M's, vocabulary 49152), its projections quantized by the
`gguf` package (Q8_0, Q4_0, Q4_1, or F32/BF16 stored as they are), the embedding in Q8_0 for the 4-bit types
(as llama.cpp's SmolLM2 Q4_0 file holds it), the norms in F32. Weights are N(0, 0.02) from a seed: the text
is noise, the bytes a token reads are those of a real model of this shape. Both engines read the same file.
Run: `.venv/bin/python benchmarks/synthetic_gguf.py --type Q4_0 OUT.gguf` then `benchmarks/gguf_peer.py
--batches 1 ... OUT.gguf`.
"""
from __future__ import annotations

import time
from pathlib import Path

import click
import gguf
import numpy as np

from phaseflip.engine.checkpoint.default_model import find_default_gguf

ARCH = "llama"
QTYPES = {name: getattr(gguf.GGMLQuantizationType, name) for name in ("F32", "BF16", "Q8_0", "Q4_0", "Q4_1")}
# keys of the copied metadata this tool sets itself (the writer adds general.architecture; the shape and
# file type follow the arguments)
SET_HERE = {"general.architecture", "general.file_type"} | {
    f"{ARCH}.{k}" for k in ("embedding_length", "block_count", "feed_forward_length", "attention.head_count",
                            "attention.head_count_kv", "rope.dimension_count", "context_length")}


def copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in SET_HERE:
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


def shapes(hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, vocab: int):
    """(name, (rows, columns)) of every tensor, the order llama.cpp writes them."""
    head_dim = hidden // heads
    yield "token_embd.weight", (vocab, hidden)
    for i in range(layers):
        b = f"blk.{i}"
        yield f"{b}.attn_norm.weight", (hidden,)
        yield f"{b}.attn_q.weight", (heads * head_dim, hidden)
        yield f"{b}.attn_k.weight", (kv_heads * head_dim, hidden)
        yield f"{b}.attn_v.weight", (kv_heads * head_dim, hidden)
        yield f"{b}.attn_output.weight", (hidden, heads * head_dim)
        yield f"{b}.ffn_norm.weight", (hidden,)
        yield f"{b}.ffn_gate.weight", (mlp, hidden)
        yield f"{b}.ffn_up.weight", (mlp, hidden)
        yield f"{b}.ffn_down.weight", (hidden, mlp)
    yield "output_norm.weight", (hidden,)


def storage(name: str, shape: tuple, qtype: str) -> gguf.GGMLQuantizationType:
    if len(shape) == 1:
        return QTYPES["F32"]
    if name == "token_embd.weight" and qtype in ("Q4_0", "Q4_1"):
        return QTYPES["Q8_0"]
    return QTYPES[qtype]


def tensor(rng: np.random.Generator, name: str, shape: tuple, kind: gguf.GGMLQuantizationType):
    if len(shape) == 1:
        return np.ones(shape, np.float32)
    data = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    return data if kind == QTYPES["F32"] else gguf.quants.quantize(data, kind)


@click.command()
@click.option("--type", "qtype", type=click.Choice(list(QTYPES)), required=True, help="The projections' storage.")
@click.option("--source", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="GGUF whose tokenizer and metadata are copied; default: the embedded SmolLM2-135M's.")
@click.option("--hidden", type=click.IntRange(min=64), default=2048, show_default=True)
@click.option("--layers", type=click.IntRange(min=1), default=24, show_default=True)
@click.option("--heads", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--kv-heads", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--mlp", type=click.IntRange(min=32), default=8192, show_default=True)
@click.option("--context", type=click.IntRange(min=64), default=8192, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
def main(qtype, source, hidden, layers, heads, kv_heads, mlp, context, seed, out):
    """Write OUT, a random-weight llama GGUF of the given shape."""
    if hidden % heads or heads % kv_heads:
        raise click.BadParameter(f"hidden={hidden}, heads={heads}, kv_heads={kv_heads}: heads must divide "
                                 "hidden and kv_heads divide heads")
    reader = gguf.GGUFReader(source or find_default_gguf())
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(out, ARCH)
    copy_metadata(reader, writer)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(mlp)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_context_length(context)
    writer.add_file_type({"F32": 0, "BF16": 32, "Q8_0": 7, "Q4_0": 2, "Q4_1": 3}[qtype])
    rng, t0 = np.random.default_rng(seed), time.perf_counter()
    for name, shape in shapes(hidden, layers, heads, kv_heads, mlp, vocab):
        kind = storage(name, shape, qtype)
        writer.add_tensor(name, tensor(rng, name, shape, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    click.echo(f"wrote {out} ({out.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
