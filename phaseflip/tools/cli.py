"""The `phaseflip` command line: boot, generate, serve, bench, convert, inspect, simulate.

Owns: argument parsing and printing for people. Everything it runs goes through the offline API
(engine/llm.py); nothing imports this module.
"""
from __future__ import annotations

import logging
import sys
import time

import click

from phaseflip.tools.bench import bench
from phaseflip.tools.boot_batch import (check_writable, print_answers, print_summary, read_prompts, write_answers,
                                        write_manifest)
from phaseflip.tools.convert import convert
from phaseflip.tools.inspect_cmd import inspect
from phaseflip.tools.simulate import simulate

# serve's step budget: prompts arrive while others decode, and one step takes a few whole prompts beside
# the decodes (vLLM's API server on the CPU has 2048 too); boot and generate keep EngineConfig's
SERVE_BUDGET = 2048


def _engine_options(budget: int | None = None):
    """The engine options of a command; `budget` is its default --max-num-batched-tokens (None:
    EngineConfig's)."""
    if budget is None:
        from phaseflip.engine.config import EngineConfig
        budget = EngineConfig.__dataclass_fields__["max_num_batched_tokens"].default

    def add(f):
        return _add_engine_options(f, budget)
    return add


def _add_engine_options(f, budget: int):
    for opt in reversed([
        click.option("--model", default=None, help="HF-format model directory or GGUF file (default: the embedded "
                     "SmolLM2-135M-Instruct)."),
        click.option("--dtype", default="auto", show_default=True, help="float32 | bfloat16 | float16 | auto"),
        click.option("--block-products", type=click.Choice(["auto", "int8", "exact"]), default="auto",
                     show_default=True, help="GGUF blocks: int8 (x quantized per block of the weights' values, "
                     "llama.cpp's numerics) | exact (x as it is) | auto (int8 where the CPU has integer dots)."),
        click.option("--max-model-len", type=int, default=None, help="Longest sequence (default: the model's)."),
        click.option("--max-num-seqs", type=int, default=64, show_default=True, help="Sequences running at once."),
        click.option("--max-num-batched-tokens", type=int, default=budget, show_default=True,
                     help="Token budget per step (the prefill chunk too)."),
        click.option("--seed", type=int, default=0, show_default=True, help="Base sampling seed."),
        click.option("--kv-cache-memory-gib", type=float, default=None,
                     help="KV pool size (default: 2 GiB on the CPU; on CUDA what --gpu-memory-utilization leaves)."),
        click.option("--gpu-memory-utilization", type=float, default=None,
                     help="CUDA: fraction of each device for weights, graphs, activations and KV (default 0.9)."),
        click.option("--world-size", type=int, default=None,
                     help="Ranks (processes). Default: 1, or WORLD_SIZE under torchrun."),
        click.option("--layouts", default=None, help="Captured layouts: pp,tp | pp | tp (default: pp,tp when world size > 1)."),
        click.option("--park", default="auto", show_default=True, help="auto | always | never: where the inactive weight image waits."),
        click.option("--flip-every-steps", type=int, default=None, help="Force a flip every K steps (testing)."),
        click.option("--pp-micro-batches", type=int, default=None,
                     help="Pieces a PP step is cut into so that the stages compute at once (default: twice "
                          "the stages; 1: whole steps)."),
        click.option("--compile", "compile_mode", type=click.Choice(["auto", "on", "off"]), default=None,
                     help="torch.compile: auto (keep it where measured faster at boot) | on | off "
                          "(default: $PHASEFLIP_COMPILE, else auto)."),
        click.option("--remeasure", is_flag=True, default=False,
                     help="Measure the boot's choices (product forms, compile per bucket) again, though the "
                          "record of an earlier boot with the same machine, model and settings has them."),
        click.option("--policy", type=click.Choice(["throughput", "latency", "drain"]), default="throughput",
                     show_default=True, help="Which layout runs next (world size > 1)."),
        click.option("--ttft-budget-s", type=float, default=None,
                     help="--policy latency: the time-to-first-token budget in seconds."),
    ]):
        f = opt(f)
    return f


def _engine_kwargs(model, dtype, block_products, max_model_len, max_num_seqs, max_num_batched_tokens, seed,
                   kv_cache_memory_gib, gpu_memory_utilization, world_size, layouts, park, flip_every_steps,
                   pp_micro_batches, compile_mode, remeasure, policy, ttft_budget_s) -> dict:
    """The engine options of the command line as LLM(...) keyword arguments."""
    from phaseflip.rank.comm import env_rank
    if world_size is None:
        world_size = env_rank()[1] if env_rank() else 1
    return dict(model=model, dtype=dtype, block_products=block_products, max_model_len=max_model_len,
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, seed=seed,
                kv_cache_memory_gib=kv_cache_memory_gib,
                gpu_memory_utilization=gpu_memory_utilization, world_size=world_size,
                layouts=tuple(layouts.split(",")) if layouts else None, park=park,
                flip_every_steps=flip_every_steps, pp_micro_batches=pp_micro_batches, compile=compile_mode,
                remeasure=remeasure, policy=policy, ttft_budget_s=ttft_budget_s)


def _llm(**engine):
    from phaseflip.engine.llm import LLM
    return LLM(**_engine_kwargs(**engine))


def _serve_if_worker() -> bool:
    """Under torchrun, ranks > 0 serve rank 0 (the controller) and print nothing."""
    from phaseflip.rank.comm import env_rank
    if env_rank() is None or env_rank()[0] == 0:
        return False
    from phaseflip.engine.ranks.torchrun import serve_torchrun_rank
    serve_torchrun_rank()
    return True


class BadValue(click.ClickException):
    """A value the engine refused (an option, a checkpoint, a file): click's bad-usage exit code."""
    exit_code = 2


class _Commands(click.Group):
    """Every command's errors that a user can fix end as one `Error: ...` line, not a traceback: a
    value the engine validated (ValueError, CheckpointError among them) or a file it could not read
    (exit code 2), a rank's failure (its first line; exit code 1). --debug re-raises them instead."""

    def invoke(self, ctx):
        from phaseflip.engine.ranks.group import EngineDeadError, RankError
        try:
            return super().invoke(ctx)
        except (ValueError, OSError, RankError, EngineDeadError) as e:
            if ctx.params.get("debug"):
                raise
            if isinstance(e, RankError):
                raise click.ClickException(f"rank {e.rank} failed: {e.error}") from e
            if isinstance(e, EngineDeadError):
                raise click.ClickException(str(e)) from e
            raise BadValue(str(e) or type(e).__name__) from e


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Log INFO lines from the engine.")
@click.option("--debug", is_flag=True, help="Show the full traceback of an error instead of its one line.")
def main(verbose: bool, debug: bool) -> None:
    """phaseflip: a graph-capture-first LLM inference engine."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


@main.command()
@_engine_options()
@click.option("--prompt", required=True, help="The prompt text (sent as is, no chat template).")
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
def generate(prompt, max_tokens, temperature, chat, **engine):
    """Generate a completion for one prompt."""
    if _serve_if_worker():
        return
    from phaseflip.engine.sampling_params import SamplingParams
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=engine["seed"])
    llm = _llm(**engine)
    with llm:
        out = (llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False) if chat
               else llm.generate(prompt, params, use_tqdm=False))
    click.echo(out[0].outputs[0].text)


@main.command()
@_engine_options()
@click.option("--prompts", "prompts_file", default=None, type=click.Path(exists=True, dir_okay=False),
              help=".txt (one chat message per line) or .jsonl ({'prompt'} or {'messages'}); default: a demo batch.")
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--output", default=None, type=click.Path(dir_okay=False), help="Write answers as JSONL here.")
@click.option("--manifest", "manifest_path", default=None, type=click.Path(dir_okay=False),
              help="Write the boot manifest here (default: the cache folder's last-manifest.json).")
def boot(prompts_file, max_tokens, temperature, output, manifest_path, **engine):
    """Load, plan, capture, run an offline batch and print the answers with a summary.

    Runs the same way under `torchrun --nproc-per-node N -m phaseflip.tools.cli boot` (rank 0 is the
    controller; the other ranks serve it)."""
    if _serve_if_worker():
        return
    from phaseflip.engine.sampling_params import SamplingParams
    check_writable(output, "--output")  # (the manifest's directory is created when missing)
    items = read_prompts(prompts_file)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=engine["seed"])
    t0 = time.perf_counter()
    llm = _llm(**engine)
    boot_s = time.perf_counter() - t0
    with llm:
        chats = [i for i, it in enumerate(items) if isinstance(it, list)]
        raws = [i for i, it in enumerate(items) if not isinstance(it, list)]
        t1 = time.perf_counter()
        outs = dict(zip(chats, llm.chat([items[i] for i in chats], params, use_tqdm=sys.stderr.isatty())
                        if chats else []))
        outs.update(zip(raws, llm.generate([items[i] for i in raws], params, use_tqdm=False) if raws else []))
        gen_s = time.perf_counter() - t1
        results = [outs[i] for i in range(len(items))]
        print_answers(items, results)
        print_summary(llm, results, boot_s, gen_s)
        write_manifest(llm, manifest_path)
    if output:
        write_answers(items, results, output)


@main.command()
@_engine_options(SERVE_BUDGET)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface).")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--api-key", default=None, envvar="PHASEFLIP_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/* (default: $PHASEFLIP_API_KEY, else none).")
@click.option("--served-model-name", default=None, help="The model name clients send (default: --model, "
                                                         "or SmolLM2-135M-Instruct).")
@click.option("--max-waiting", type=int, default=None,
              help="Sequences that may wait for a slot before new requests get 503 (default: the larger of "
                   "2 x --max-num-seqs and the KV pool's block count).")
@click.option("--shutdown-timeout", type=float, default=10.0, show_default=True,
              help="Seconds requests in flight may run on after SIGTERM / Ctrl-C.")
@click.option("--max-request-bytes", type=int, default=8 << 20, show_default=True,
              help="Bodies over this are refused (413) before they are parsed.")
def serve(host, port, api_key, served_model_name, max_waiting, shutdown_timeout, max_request_bytes, **engine):
    """Serve the model over an OpenAI-compatible HTTP API (completions, chat, streaming, /metrics)."""
    if _serve_if_worker():
        return
    from phaseflip.serve.server import ServeConfig, serve as run_server
    config = ServeConfig(host=host, port=port, api_key=api_key, served_model_name=served_model_name,
                         max_waiting=max_waiting, shutdown_timeout_s=shutdown_timeout,
                         max_request_bytes=max_request_bytes,
                         log_level="info" if logging.getLogger().level <= logging.INFO else "warning")
    sys.exit(run_server(_engine_kwargs(**engine), config))


main.add_command(bench)
main.add_command(convert)
main.add_command(inspect)
main.add_command(simulate)

if __name__ == "__main__":
    main()
