"""The rank template (engine/ranks/template.py, template_process.py): CPU ranks forked from one process that imported their
code once, each what a fresh rank would be (this process's stderr, environment and working directory of
the moment, a session of its own, numpy's generator reseeded, its exit reported); fresh interpreters where
the template must not serve; the template's death takes its ranks with it, the engine says so, and an
idle template leaves."""
import json
import os
import signal
import types

import numpy as np
import pytest

from phaseflip import LLM, SamplingParams
from phaseflip.engine.ranks import template_process
from phaseflip.engine.ranks.group import EngineDeadError
from tests import background
from tests.reliability.support import alive, wait_gone

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


def boot(model):
    return LLM(model=model, dtype="float32", world_size=2, layouts=("tp",))


def parents(llm) -> set[int]:
    found = set()
    for pid in llm.stats()["rank_pids"]:
        with open(f"/proc/{pid}/stat") as f:
            found.add(int(f.read().rsplit(")", 1)[1].split()[1]))
    return found


def is_template(pid: int) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return b"phaseflip.engine.ranks.template" in f.read()


def test_boots_fork_their_ranks_from_one_template_with_the_same_outputs(model):
    seen, outs = [], []
    for _ in range(2):
        with boot(model) as llm:
            seen.append(parents(llm))
            outs.append(llm.generate(["the quick brown fox"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
    assert seen[0] == seen[1] and len(seen[0]) == 1, seen
    (template,) = seen[0]
    assert template != os.getpid() and is_template(template)
    assert outs[0] == outs[1] and len(outs[0]) == 6


def test_a_forked_rank_writes_to_the_stderr_this_process_has_now(model, capfd):
    with capfd.disabled():   # the template starts (or already runs) with another stderr than the test's
        with boot(model):
            pass
    with boot(model) as llm:
        assert os.getpid() not in parents(llm)
        os.kill(llm.stats()["rank_pids"][1], signal.SIGUSR1)   # faulthandler: every stack, to its stderr
        err = ""
        for _ in range(100):
            llm.generate(["a b"], GREEDY, use_tqdm=False)
            err += capfd.readouterr().err
            if "most recent call first" in err:
                break
    assert "most recent call first" in err, err[-2000:]


def test_a_forked_child_is_given_the_environment_directory_stderr_and_a_session(tmp_path):
    """_fork's child, up to the rank's main (a stub that records what it sees): nothing left of the
    template's environment or directory, the stderr it was sent, its own session, numpy's generator reseeded."""
    def main(*args):
        with open(tmp_path / f"seen-{os.getpid()}.json", "w") as f:
            json.dump(dict(args=args[:4], env=dict(os.environ), cwd=os.getcwd(), sid=os.getsid(0),
                           stderr=os.readlink("/proc/self/fd/2"), draw=np.random.random()), f)
    stub = types.SimpleNamespace(__file__="stub.py", main=main)
    env = {"PHASEFLIP_SEEN": "yes", "PATH": os.environ.get("PATH", "")}
    (tmp_path / "work").mkdir()
    np.random.seed(7)   # the parent's: without the reseed, both children would draw the same number
    with open(tmp_path / "err.txt", "w") as err:
        pids = []
        for _ in range(2):
            passed = os.dup(err.fileno())
            pids.append(template_process._fork(stub, ["1", "2", "tcp://x", "h:1"], env, str(tmp_path / "work"),
                                               [2], [passed], ()))
            os.close(passed)
    for pid in pids:
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    seen = [json.loads((tmp_path / f"seen-{pid}.json").read_text()) for pid in pids]
    for pid, s in zip(pids, seen):
        assert s["args"] == [1, 2, "tcp://x", "h:1"]
        assert s["env"] == env and s["cwd"] == str(tmp_path / "work")
        assert s["sid"] == pid and s["stderr"] == str(tmp_path / "err.txt")
    assert seen[0]["draw"] != seen[1]["draw"]


def test_fresh_interpreters_when_asked_and_a_bad_value_named(model, monkeypatch):
    """Fresh interpreters: the listener's key travels in their environment, which only this user can
    read, not on their command line, which every user can (/proc/PID/cmdline)."""
    monkeypatch.setenv("PHASEFLIP_RANK_TEMPLATE", "0")
    with boot(model) as llm:
        assert parents(llm) == {os.getpid()}
        for pid in llm.ranks.pids:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")[:-1]
            assert argv[1:3] == [b"-m", b"phaseflip.engine.ranks.process"] and len(argv) == 9, argv
            assert argv[6].startswith(b"/"), "the control address is a socket path"
            with open(f"/proc/{pid}/environ", "rb") as f:
                key = [v for v in f.read().split(b"\0") if v.startswith(b"PHASEFLIP_RANK_AUTHKEY=")]
            assert len(key) == 1 and not any(key[0].split(b"=", 1)[1] in arg for arg in argv)
        assert len(llm.generate(["a b c"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6
    monkeypatch.setenv("PHASEFLIP_RANK_TEMPLATE", "yes")
    with pytest.raises(ValueError, match=r"PHASEFLIP_RANK_TEMPLATE='yes': expected 1 .* or 0"):
        boot(model)


def test_a_changed_import_time_variable_gets_a_new_template_and_the_old_one_leaves(model, monkeypatch):
    monkeypatch.setenv("PHASEFLIP_RANK_TEMPLATE_IDLE_S", "1.0")
    monkeypatch.setenv("TORCH_PHASEFLIP_TEST_MARK", "before")   # TORCH*: torch may read such at import
    with boot(model) as first:
        (old,) = parents(first)
        monkeypatch.setenv("TORCH_PHASEFLIP_TEST_MARK", "after")
        with boot(model) as second:
            (new,) = parents(second)
            assert new not in (old, os.getpid()) and is_template(new)
            assert alive(old), "a template went before its ranks"
    with boot(model) as third:
        assert parents(third) == {new}
    assert wait_gone([old], 10.0) == [], "the old environment's template stayed"


def test_a_killed_template_takes_its_ranks_and_the_engine_says_so(model, monkeypatch):
    monkeypatch.setenv("TORCH_PHASEFLIP_TEST_MARK", "killed")   # a template of this test's own
    llm = boot(model)
    pids = llm.stats()["rank_pids"]
    (template,) = parents(llm)
    os.kill(template, signal.SIGKILL)
    assert wait_gone(pids, 10.0) == [], "ranks outlived their template"
    with pytest.raises(EngineDeadError, match=r"rank \d \(pid \d+\) died \(signal SIGKILL\)"):
        llm.generate(["a b"], GREEDY, use_tqdm=False)
    llm.shutdown()
    with boot(model) as again:
        assert template not in parents(again)
        assert len(again.generate(["a b"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6


def test_an_idle_template_leaves(model, monkeypatch):
    monkeypatch.setenv("PHASEFLIP_RANK_TEMPLATE_IDLE_S", "0.5")
    monkeypatch.setenv("TORCH_PHASEFLIP_TEST_MARK", "idle")   # a template started with this idle time
    with boot(model) as llm:
        (template,) = parents(llm)
        assert alive(template)
    assert wait_gone([template], 10.0) == [], "the template stayed with no rank to serve"


def test_no_process_of_the_engine_outlives_shutdown_by_10_s(model, monkeypatch):
    """By default (no PHASEFLIP_RANK_TEMPLATE_IDLE_S) a template leaves a few seconds after its last
    rank: nothing the engine started is alive 10 s after shutdown()."""
    import psutil
    monkeypatch.delenv("PHASEFLIP_RANK_TEMPLATE_IDLE_S")
    monkeypatch.setenv("TORCH_PHASEFLIP_TEST_MARK", "default-idle")   # a template started now, with the default
    def children() -> set[int]:   # the suite's background jobs are not the engine's
        return {p.pid for p in psutil.Process().children(recursive=True)} - background.pids()
    before = children()
    with boot(model) as llm:
        started = children() - before
        assert set(llm.ranks.pids) <= started and any(is_template(pid) for pid in started)
    assert wait_gone(sorted(started), 10.0) == [], "a process of the engine outlived shutdown() by 10 s"


def test_a_bad_idle_time_is_named(model, monkeypatch):
    monkeypatch.setenv("PHASEFLIP_RANK_TEMPLATE_IDLE_S", "soon")
    monkeypatch.setenv("TORCH_PHASEFLIP_TEST_MARK", "bad-idle")
    with pytest.raises(ValueError, match=r"PHASEFLIP_RANK_TEMPLATE_IDLE_S='soon': expected the seconds"):
        boot(model)
