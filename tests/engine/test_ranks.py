"""Rank processes: failures reach the caller with the rank, a dead rank never hangs generate, no
process outlives the engine or its controller, and torchrun runs the same boot."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from phaseflip import LLM, SamplingParams
from phaseflip.engine.ranks.group import EngineDeadError, RankError
from phaseflip.rank.messages import ArmFault
from tests import background
from tests.reliability.support import alive, wait_gone

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


def test_rank_exception_names_the_rank_then_engine_is_dead(model):
    llm = LLM(model=model, dtype="float32", world_size=2)
    pids = llm.stats()["rank_pids"]
    llm.ranks.call(ArmFault("step", rank=1))
    with pytest.raises(RankError, match=r"rank 1 failed: InjectedFault") as info:
        llm.generate(["hello world"], GREEDY, use_tqdm=False)
    assert "Traceback" in info.value.rank_traceback and "run_step" in info.value.rank_traceback
    with pytest.raises(EngineDeadError, match="engine is dead: rank 1 failed"):
        llm.generate(["hello again"], GREEDY, use_tqdm=False)
    llm.shutdown()
    assert wait_gone(pids) == []


def test_killed_rank_raises_engine_dead_within_30s_and_leaves_no_process(model):
    llm = LLM(model=model, dtype="float32", world_size=2, max_model_len=256)
    pids = llm.stats()["rank_pids"]
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    threading.Timer(1.5, os.kill, (pids[1], signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"rank 1 .*died"):
        for _ in range(20):  # long enough that the kill lands mid-generate
            llm.generate(["the quick brown fox"] * 4, long, use_tqdm=False)
    assert time.monotonic() - t0 < 1.5 + 30
    assert wait_gone(pids) == []
    llm.shutdown()


def test_shutdown_leaves_no_process(model):
    with LLM(model=model, dtype="float32", world_size=2, layouts=("tp",)) as llm:
        pids = llm.stats()["rank_pids"]
        llm.generate(["a b c"], GREEDY, use_tqdm=False)
    assert wait_gone(pids, 10.0) == []


@pytest.mark.parametrize("built_in", ["main thread", "short-lived thread"])
def test_ranks_exit_when_the_controller_is_killed(model, tmp_path, built_in):
    """The ranks and the rank template they were forked from: with PR_SET_PDEATHSIG when the main
    thread started them, through the template's socket when a thread that has ended did."""
    script = tmp_path / "controller.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys, threading, time
        from phaseflip import LLM
        from phaseflip.engine.ranks import template as rank_template
        engines = []
        build = lambda: engines.append(LLM(model={model!r}, dtype="float32", world_size=2))
        if {built_in == "main thread"}:
            build()
        else:
            thread = threading.Thread(target=build)
            thread.start()
            thread.join()
        print(json.dumps(engines[0].stats()["rank_pids"] + [rank_template._template.proc.pid]), flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=os.getcwd())
    pids = json.loads(proc.stdout.readline())
    assert all(alive(p) for p in pids)
    proc.kill()
    proc.wait()
    assert wait_gone(pids, 10.0) == [], "rank processes or their template outlived their controller"


@background.register("torchrun_and_spawn_boots")
def _torchrun_and_spawn_boots(session: background.Session) -> tuple[background.Job, ...]:
    """`phaseflip boot` of the tiny llama on 2 ranks under torchrun, then spawned by the CLI itself."""
    out = session.mktemp("torchrun")
    prompts = out / "p.jsonl"
    prompts.write_text('{"prompt": "the quick brown fox"}\n{"prompt": "hello world, this is"}\n')
    args = ["boot", "--model", str(session.fixture("tiny_model_dir")("llama")), "--prompts", str(prompts),
            "--max-tokens", "8", "--layouts", "pp,tp", "--flip-every-steps", "2"]
    elastic = {**os.environ, "TMPDIR": str(out)}   # torchrun's agent leaves a torchelastic_* dir in the temp dir
    return (background.python("-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "phaseflip.tools.cli",
                               *args, "--output", str(out / "torchrun.jsonl"), env=elastic, out_dir=out),
            background.python("-m", "phaseflip.tools.cli", *args, "--world-size", "2",
                              "--output", str(out / "spawn.jsonl"), out_dir=out))


@pytest.fixture(scope="session")
def torchrun_and_spawn_boots(_background_jobs):
    return _background_jobs["torchrun_and_spawn_boots"]


def test_torchrun_runs_the_same_boot(torchrun_and_spawn_boots):
    outs = {}
    for mode, job in zip(("torchrun", "spawn"), torchrun_and_spawn_boots):
        r = job.result(timeout_s=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "flip pp->tp" in r.stdout and "== summary ==" in r.stdout
        lines = (job.out_dir / f"{mode}.jsonl").read_text().splitlines()
        outs[mode] = [json.loads(line)["token_ids"] for line in lines]
    assert outs["torchrun"] == outs["spawn"]


def test_a_rank_process_imports_no_compiler_until_it_compiles():
    """torch._dynamo costs a rank ~1.6 s to import; comm's graph breaks are applied when a rank is about
    to compile (break_graphs_at_collectives), not at import."""
    code = ("import sys, phaseflip.engine.ranks.process; "
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported at import'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
