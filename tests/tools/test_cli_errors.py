"""Every command turns a bad value of each of its options into one `Error: ...` line with
a non-zero exit code (2: click's bad usage), before any work; `--debug` shows the traceback instead."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from phaseflip.tools.cli import main

ENGINE_OPTIONS = [  # (option, bad value, what the error line must name)
    ("--dtype", "float8", "dtype='float8'"),
    ("--max-model-len", "0", "max_model_len=0"),
    ("--max-num-seqs", "0", "max_num_seqs=0"),
    ("--max-num-batched-tokens", "-4", "max_num_batched_tokens=-4"),
    ("--seed", "one", "'one' is not a valid integer"),
    ("--world-size", "0", "world_size=0"),
    ("--layouts", "pp,xx", "layouts=('pp', 'xx')"),
    ("--park", "sometimes", "park='sometimes'"),
    ("--flip-every-steps", "0", "flip_every_steps=0"),
    ("--pp-micro-batches", "0", "pp_micro_batches=0"),
    ("--compile", "maybe", "'maybe' is not one of"),
    ("--model", "/no/such/model", "/no/such/model"),
]
CASES = (
    [("generate", "--prompt", "x", opt, bad, says) for opt, bad, says in ENGINE_OPTIONS]
    + [("boot", opt, bad, says) for opt, bad, says in ENGINE_OPTIONS]
    + [("generate", "--prompt", "x", "--max-tokens", "-3", "max_tokens=-3"),
       ("generate", "--prompt", "x", "--temperature", "-1", "temperature=-1.0"),
       ("boot", "--max-tokens", "0", "max_tokens=0"),
       ("boot", "--temperature", "-2", "temperature=-2.0"),
       ("boot", "--prompts", "/no/such/prompts.txt", "/no/such/prompts.txt"),
       ("boot", "--output", "missing-dir/out.jsonl", "missing-dir"),  # relative to the test's temp dir
       ("bench", "--threads", "0", "0 is not in the range x>=1"),
       ("bench", "--num-prompts", "0", "0 is not in the range x>=1"),
       ("bench", "--prompt-len", "40,8", "low first"),
       ("bench", "--output-len", "x", "is not two integers"),
       ("bench", "--single-len", "16,1", "ms per token needs >= 2"),
       ("bench", "--hf-batch-size", "0", "0 is not in the range x>=1"),
       ("bench", "--parts", "warp", "unknown part(s) ['warp']"),
       ("bench", "--flip-world-size", "0", "0 is not in the range x>=1"),
       ("bench", "--model", "/no/such/model", "/no/such/model"),
       ("inspect", "/no/such/manifest.json", "no manifest at /no/such/manifest.json"),
       ("inspect", "--world-size", "0", "world_size=0"),
       ("inspect", "--boot", "--layouts", "xx", "layouts=('xx',)"),
       ("inspect", "--model", "/no/such/model", "/no/such/model"),
       ("inspect", "--dot", "missing-dir/g.dot", "missing-dir"),
       ("inspect", "--svg", "missing-dir/m.svg", "missing-dir"),
       ("simulate", "--rig", "nowhere", "--trace", "mixed-trace.jsonl", "nowhere"),
       ("simulate", "--rig", "hetero-3card", "--trace", "/no/trace.jsonl", "/no/trace.jsonl"),
       ("simulate", "--rig", "hetero-3card", "--trace", "mixed-trace.jsonl", "--ttft-budget-s", "0", "> 0"),
       ("convert", "/no/such.gguf", "out", "/no/such.gguf")])


def _args_id(case) -> str:
    return " ".join(case[:-1])


@pytest.mark.parametrize("case", CASES, ids=_args_id)
def test_a_bad_value_is_one_error_line(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    *args, says = case
    result = CliRunner().invoke(main, args)
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert isinstance(result.exception, SystemExit), f"exit {result.exit_code}: {result.exception!r}"
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert [ln for ln in lines if ln.startswith("Error:")] == lines[-1:], result.output
    assert says in lines[-1], result.output


def test_debug_shows_the_traceback():
    result = CliRunner().invoke(main, ["--debug", "generate", "--prompt", "x", "--max-tokens", "-3"])
    assert isinstance(result.exception, ValueError) and "max_tokens=-3" in str(result.exception)
