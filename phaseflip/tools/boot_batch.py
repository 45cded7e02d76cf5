"""`phaseflip boot`'s batch: the prompts it reads and the answers, summary and manifest it writes.

Owns: the demo batch (DEMO_PROMPTS, chat messages when no --prompts file is given), reading a --prompts
file (.txt: a chat message per line; .jsonl: {"prompt"} or {"messages"} per line, a bad line named),
and printing the answers and the summary of the boot, the flips and the generate for a person.
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from phaseflip.tools.inspect_cmd import default_manifest_path

DEMO_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning to program.",
    "Explain in one sentence what a CPU does.",
    "What is 12 times 7?",
    "Name three primary colors.",
    "Translate 'good morning' into Spanish.",
    "What is photosynthesis? Answer briefly.",
)


def read_prompts(path: str | None) -> list:
    """A .txt file is one chat message per line; a .jsonl file has {"prompt": ...} or {"messages": [...]}."""
    if path is None:
        return [[{"role": "user", "content": p}] for p in DEMO_PROMPTS]
    with open(path, encoding="utf-8") as f:
        lines = [ln.rstrip("\n") for ln in f if ln.strip()]
    if not lines:
        raise click.BadParameter(f"{path} holds no prompt (it is empty)", param_hint="--prompts")
    if not path.endswith(".jsonl"):
        return [[{"role": "user", "content": ln}] for ln in lines]
    items = []
    for n, ln in enumerate(lines, 1):
        try:
            obj = json.loads(ln)
        except json.JSONDecodeError as e:
            raise click.BadParameter(f"{path} line {n} is not JSON: {e}") from e
        if not isinstance(obj, dict):
            raise click.BadParameter(f"{path} line {n}: expected a JSON object, got {type(obj).__name__}")
        items.append(_prompt_of(obj, f"{path} line {n}"))
    return items


def _prompt_of(obj: dict, where: str):
    """A prompts-file line's prompt: its "messages" (a list of {role, content} objects) or its "prompt"
    (a string, or a list of token ids)."""
    if "messages" in obj:
        m = obj["messages"]
        if isinstance(m, list) and m and all(isinstance(x, dict) for x in m):
            return m
        raise click.BadParameter(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects, "
                                 f"got {json.dumps(m)[:60]}")
    if "prompt" in obj:
        p = obj["prompt"]
        if isinstance(p, str) or (isinstance(p, list) and p and all(type(t) is int for t in p)):
            return p
        raise click.BadParameter(f"{where}: 'prompt' must be a string or a list of token ids, got {json.dumps(p)[:60]}")
    raise click.BadParameter(f"{where}: needs a 'prompt' or 'messages' field")


def check_writable(path: str | None, option: str) -> None:
    """Before the boot: a file to write at the end must have a directory to go in."""
    if path is not None and not Path(path).absolute().parent.is_dir():
        raise click.BadParameter(f"{path}: its directory does not exist", param_hint=option)


def write_manifest(llm, path) -> None:
    target = Path(path) if path else default_manifest_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(llm.inspect(), indent=1))
    click.echo(f"manifest: {target} (see `phaseflip inspect {target}`)")


def print_answers(items, results) -> None:
    for it, r in zip(items, results):
        question = it[-1]["content"] if isinstance(it, list) else it
        click.echo(f"\n>>> {question}\n{r.outputs[0].text.strip()}")


def print_summary(llm, results, boot_s: float, gen_s: float) -> None:
    stats = llm.stats()
    n_out = sum(len(r.outputs[0].token_ids) for r in results)
    n_in = sum(len(r.prompt_token_ids) for r in results)
    ttfts = sorted(r.metrics.time_to_first_token for r in results if r.metrics.time_to_first_token is not None)
    click.echo("\n== summary ==")
    click.echo("boot: " + ", ".join(f"{k} {v:.0f} ms" for k, v in stats["boot_ms"].items())
               + f" (total {boot_s * 1e3:.0f} ms)")
    for rank, phases in enumerate(stats["rank_boot_ms"]):   # where the ranks phase went
        click.echo(f"  rank {rank}: " + ", ".join(f"{k} {v:.0f}" for k, v in phases.items() if v >= 100) + " ms")
    click.echo(f"ranks: {stats['world_size']}, layouts {','.join(stats['layouts'])}; captured steps: "
               f"{stats['captures_at_boot']} at boot, {stats['captures_after_boot']} after")
    click.echo(f"kv: {stats['num_kv_blocks']} blocks = {stats['num_kv_blocks'] * llm.plan.shapes.block_size} "
               f"tokens ({stats['kv_sized_by']})")
    for e in stats["flip_log"]:
        parts = ", ".join(f"{c} {e[c + '_ms']:.1f}" for c in ("read", "exchange", "refill", "write", "cutover")
                          if e.get(c + "_ms") is not None)
        state = "ok" if e["ok"] else f"FAILED at {e['failed_stage']}: {e['error']}"
        click.echo(f"flip {e['direction']}: {e['total_ms']:.1f} ms ({parts}); kv {e['kv_bytes']} B, "
                   f"weights {e['weight_bytes']} B; {state}")
    click.echo(f"requests: {len(results)}; prompt tokens {n_in}; output tokens {n_out}; "
               f"steps {stats['steps']}; preemptions {stats['num_preemptions']}")
    click.echo(f"generate: {gen_s:.2f} s, {n_out / gen_s:.1f} output tok/s, "
               f"{(n_in + n_out) / gen_s:.1f} total tok/s"
               + (f"; median TTFT {ttfts[len(ttfts) // 2] * 1e3:.0f} ms" if ttfts else ""))


def write_answers(items, results, path: str) -> None:
    """--output: one JSON line per prompt with its answer's text, tokens and finish reason."""
    with open(path, "w", encoding="utf-8") as f:
        for it, r in zip(items, results):
            f.write(json.dumps({"prompt": it, "text": r.outputs[0].text, "token_ids": r.outputs[0].token_ids,
                                "finish_reason": r.outputs[0].finish_reason}) + "\n")
    click.echo(f"wrote {len(results)} answers to {path}")
