"""The `phaseflip` command line, in-process through click's CliRunner: help, generate, boot; a small
`phaseflip bench` in a process of its own beside the suite (tests/background.py).

Every test runs on a tiny random model except the one acceptance test of `phaseflip boot` with no
arguments, which runs the demo batch on the embedded default SmolLM2-135M-Instruct.
"""
import json

import pytest
from click.testing import CliRunner

from phaseflip import LLM, SamplingParams
from phaseflip.tools.boot_batch import DEMO_PROMPTS
from phaseflip.tools.cli import main
from tests import background

SUMMARY_LINES = ("== summary ==", "boot: load", "capture", "captured steps:", "requests:",
                 "output tok/s", "total tok/s")


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)


def _ok(result):
    assert result.exit_code == 0, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    return result.output


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return str(tiny_model_dir("llama"))


# -- help ----------------------------------------------------------------------------------------
def test_main_help_lists_every_subcommand():
    out = _ok(_invoke("--help"))
    assert "Usage:" in out
    for name in ("boot", "generate", "convert"):
        assert name in out


@pytest.mark.parametrize("name", sorted(main.commands))
def test_every_subcommand_has_help(name):
    out = _ok(_invoke(name, "--help"))
    assert f"Usage: main {name}" in out or f"{name} [OPTIONS]" in out
    if name in ("boot", "generate"):
        for opt in ("--model", "--dtype", "--max-model-len", "--max-num-seqs",
                    "--max-num-batched-tokens", "--seed", "--max-tokens", "--temperature"):
            assert opt in out, f"{name} --help does not document {opt}"


def test_the_three_subcommands_exist():
    assert {"boot", "generate", "convert"} <= set(main.commands)


# -- generate ------------------------------------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True])
def test_generate_prints_the_completion(tiny, chat):
    prompt = "The quick brown fox"
    out = _ok(_invoke("generate", "--model", tiny, "--prompt", prompt, "--max-tokens", 5,
                      *(["--chat"] if chat else [])))
    # the same request through the offline API, with the CLI's defaults
    params = SamplingParams(temperature=0.0, max_tokens=5, seed=0)
    with LLM(model=tiny, max_num_seqs=64, max_num_batched_tokens=512, seed=0) as llm:
        ref = (llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False) if chat
               else llm.generate(prompt, params, use_tqdm=False))[0].outputs[0]
    assert 1 <= len(ref.token_ids) <= 5
    assert out == ref.text + "\n"


def test_generate_needs_a_prompt(tiny):
    result = _invoke("generate", "--model", tiny)
    assert result.exit_code == 2 and "--prompt" in result.output


# -- boot on the tiny model ----------------------------------------------------------------------
def _check_summary(out: str, num_requests: int) -> None:
    for line in SUMMARY_LINES:
        assert line in out, f"summary line {line!r} missing:\n{out}"
    assert f"requests: {num_requests};" in out
    assert "captured steps:" in out and "0 after" in out


def _read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(ln) for ln in f]


def test_boot_txt_prompts_to_jsonl(tiny, tmp_path):
    questions = ["Hello there", "What is 2 + 2?", "Pack my box with five dozen liquor jugs"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(questions[:2]) + "\n\n" + questions[2] + "\n")  # blank line skipped
    out_path = tmp_path / "out.jsonl"
    out = _ok(_invoke("boot", "--model", tiny, "--prompts", prompts, "--max-tokens", 8,
                      "--output", out_path))
    for q in questions:
        assert f">>> {q}\n" in out
    _check_summary(out, len(questions))
    assert f"wrote 3 answers to {out_path}" in out
    rows = _read_jsonl(out_path)
    assert len(rows) == len(questions)
    for q, row in zip(questions, rows):
        assert row["prompt"] == [{"role": "user", "content": q}]
        assert 1 <= len(row["token_ids"]) <= 8
        assert row["finish_reason"] in ("length", "stop")
        assert f">>> {q}\n{row['text'].strip()}" in out


def test_boot_jsonl_prompts_and_messages(tiny, tmp_path):
    items = [
        {"prompt": "The quick brown fox"},
        {"messages": [{"role": "user", "content": "What is 2 + 2?"}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                      {"role": "user", "content": "Numbers please"}]},
        {"prompt": "Hello, world!"},
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(it) + "\n" for it in items))
    out_path = tmp_path / "out.jsonl"
    out = _ok(_invoke("boot", "--model", tiny, "--prompts", prompts, "--max-tokens", 8,
                      "--output", out_path))
    for q in ("The quick brown fox", "What is 2 + 2?", "Numbers please", "Hello, world!"):
        assert f">>> {q}\n" in out
    _check_summary(out, len(items))
    rows = _read_jsonl(out_path)
    assert len(rows) == len(items)
    for it, row in zip(items, rows):   # answers come back in the file's order
        assert row["prompt"] == it.get("prompt", it.get("messages"))
        assert 1 <= len(row["token_ids"]) <= 8


@pytest.mark.parametrize("bad_line,message", [
    ('{"text": "no prompt field"}', "needs a 'prompt' or 'messages' field"),
    ("not json at all", "is not JSON"),
    ('"a prompt without its object"', "expected a JSON object, got str"),
    ('{"prompt": 123}', "'prompt' must be a string or a list of token ids, got 123"),
    ('{"messages": "hi"}', "'messages' must be a non-empty list of {role, content} objects"),
])
def test_boot_jsonl_bad_line_is_a_clear_error(tiny, tmp_path, bad_line, message):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": "fine"}\n' + bad_line + "\n")
    result = _invoke("boot", "--model", tiny, "--prompts", prompts)
    assert result.exit_code == 2, f"{result.exit_code}: {result.exception!r}\n{result.output}"
    assert "line 2" in result.output and message in result.output
    assert "== summary ==" not in result.output


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.txt"])
def test_boot_refuses_an_empty_prompts_file_before_booting(tiny, tmp_path, name):
    prompts = tmp_path / name
    prompts.write_text("\n")
    result = _invoke("boot", "--model", tiny, "--prompts", prompts)
    assert result.exit_code == 2 and "holds no prompt" in result.output and "== summary ==" not in result.output


def test_a_latency_budget_must_be_positive(tiny):
    result = _invoke("boot", "--model", tiny, "--policy", "latency", "--ttft-budget-s", "-1", "--world-size", "2")
    assert result.exit_code == 2 and "ttft_budget_s=-1.0 is invalid: must be > 0" in result.output, result.output
    assert "== summary ==" not in result.output


# -- the acceptance: `phaseflip boot` with no arguments -----------------------------------------

def test_boot_without_arguments_runs_the_demo_on_smollm2(default_model_dir):
    """The embedded default SmolLM2-135M-Instruct, the demo batch, 64 tokens each (~30-60 s on 2 cores)."""
    out = _ok(_invoke("boot"))
    assert "Paris" in out, out
    for q in DEMO_PROMPTS:
        assert f">>> {q}\n" in out
    _check_summary(out, len(DEMO_PROMPTS))


# -- bench ---------------------------------------------------------------------------------------
@background.register("bench_json")
def _bench_json(session: background.Session) -> background.Job:
    """A small `phaseflip bench --json` of the tiny llama, in a process of its own."""
    tiny = str(session.fixture("tiny_model_dir")("llama"))
    return background.python("-m", "phaseflip.tools.cli", "bench", "--model", tiny, "--num-prompts", "3",
                             "--prompt-len", "8,40", "--output-len", "4,12", "--single-len", "16,6",
                             "--prefix-len", "40", "--json")


@pytest.fixture(scope="session")
def bench_json(_background_jobs):
    return _background_jobs["bench_json"]


def test_bench_compares_with_hf_on_the_same_tokens(bench_json):
    """A small `phaseflip bench --json` on the tiny model: both engines run the same token ids, their
    greedy fp32 outputs agree, and every ratio is a measured number (flips: two ranks, both layouts)."""
    done = bench_json.result(timeout_s=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    off, single = report["compare"]["offline"], report["compare"]["single"]
    assert off["requests"] == 3 and off["equal_to_hf"] == 3
    assert off["engine_tok_s"] > 0 and off["hf_tok_s"] > 0 and off["ratio"] > 0
    assert single["ttft_ratio"] > 0
    for side in (single["engine"], single["hf"]):   # a per-token figure: measured, or None and why
        assert side["tokens_per_s"] > 0 if side["tokens_per_s"] is not None else side["why_no_per_token"]
    assert single["decode_ratio"] is None or single["decode_ratio"] > 0
    flips = report["flips"]["flips"]
    assert flips and all(f["ok"] and f["floor_ms"] > 0 and f["ratio"] > 0 for f in flips)
    pack = report["flips"]["pack"]
    assert report["flips"]["first_touch_gbps"] > 0 and [r["rank"] for r in pack["ranks"]] == [0, 1]
    assert all(r["bytes"] > 0 and r["of_memcpy"] > 0 and r["of_first_touch"] > 0 for r in pack["ranks"] + [pack["all"]])
    prefix = report["prefix"]
    # equal but for near-tie flips (fp32 sums in another order): a wrong cache changes nearly all
    assert prefix["requests"] == 64 and prefix["on_equal_to_off"] >= 60
    assert prefix["on_vs_off"] > 0 and prefix["on_vs_hf"] > 0
    assert prefix["prefix_cache"]["prompt_tokens_reused"] > 0


@pytest.mark.parametrize("args,message", [
    (("--prompt-len", "40,8"), "need two integers >= 1, low first"),
    (("--output-len", "x"), "is not two integers"),
    (("--single-len", "16,1"), "ms per token needs >= 2"),
    (("--parts", "offline,warp"), "unknown part(s) ['warp']"),
])
def test_bench_rejects_bad_options_before_running(tiny, args, message):
    result = _invoke("bench", "--model", tiny, *args)
    assert result.exit_code != 0 and message in result.output


def test_single_stream_alternates_lengths_and_gives_none_where_noise_swamps_the_difference():
    from phaseflip.tools.bench_single import single_stream
    calls = []
    steady = single_stream(lambda k: calls.append(k) or 0.010 + 0.002 * k, n=6)
    assert calls == [1, 6, 1, 6, 1, 6]
    assert steady["ttft_ms"] == pytest.approx(12.0) and steady["ms_per_token"] == pytest.approx(2.0)
    slow_spell = iter([0.050, 0.020, 0.050, 0.020, 0.012, 0.022])   # the short runs' median above the long
    noisy = single_stream(lambda k: next(slow_spell), n=6)
    assert noisy["ms_per_token"] is None and noisy["tokens_per_s"] is None
    assert "noise" in noisy["why_no_per_token"]
