"""Compiled steps on the CPU (prefill: one decoder layer compiled by inductor and reused by every layer;
decode: the whole step as one graph): the
measured choice per bucket is recorded and used, outputs match HF, compiling and capturing write nothing
into the KV region, the layer compiles once whatever the number of layers, and no step compiles after
boot. Slow-marked where inductor compiles cold for tens of seconds on 2 cores."""
import dataclasses
import functools
import json
import os
import sys

import pytest
import torch
from torch._dynamo.utils import counters

from phaseflip import LLM, SamplingParams
from phaseflip.graphs.buffers import StaticBuffers
from phaseflip.graphs.capture import StepKey, capture_eager
from phaseflip.kernels.cpu import fused_layer
from phaseflip.kernels.cpu.linear import SMALL_BATCH
from phaseflip.rank import compile_choice as choice_module
from phaseflip.rank import runtime as runtime_module
from phaseflip.rank.messages import Phase
from phaseflip.rank.runner import LayoutRunner
from phaseflip.rank.step_inputs import phase_buckets
from phaseflip.tools.inspect_cmd import boot_table
from tests import background
from tests.engine.test_parity import parity_prompts
from tests.models import compare_greedy, hf_greedy

ROLES = ("prefill", "decode")


def _boot(d, compile_mode, tmp_path, monkeypatch, decode_buckets=(1, 2, 4)):
    monkeypatch.setenv("PHASEFLIP_CACHE", str(tmp_path))
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    torch._dynamo.reset()  # forget graphs an earlier test compiled for the same layer function
    counters.clear()
    return LLM(model=str(d), dtype="float32", compile=compile_mode, max_num_seqs=8, max_num_batched_tokens=128,
               decode_buckets=decode_buckets, prefill_buckets=(64, 128))


@background.register("fresh_process_cache_dirs")
def _fresh_process_cache_dirs(session: background.Session) -> tuple[background.Job, background.Job]:
    """As at a boot: torch._dynamo imported first (in torch 2.13 the import writes inductor's default
    dir into TORCHINDUCTOR_CACHE_DIR), then use_cache_dir; without, then with a directory the user names."""
    script = ("import sys, torch._dynamo\n"
              "from phaseflip.graphs.compile import use_cache_dir\n"
              "print(use_cache_dir(sys.argv[1])['TORCHINDUCTOR_CACHE_DIR'])")
    root = session.mktemp("fresh-process-cache")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    return (background.python("-c", script, str(root), env=env, out_dir=root),
            background.python("-c", script, str(root), env={**env, "TORCHINDUCTOR_CACHE_DIR": str(root / "mine")},
                              out_dir=root))


@pytest.fixture(scope="session")
def fresh_process_cache_dirs(_background_jobs):
    return _background_jobs["fresh_process_cache_dirs"]


def test_compile_caches_go_below_the_phaseflip_cache_in_a_fresh_process(fresh_process_cache_dirs):
    """A directory the user names stays theirs."""
    unset, named = (job.result(timeout_s=600) for job in fresh_process_cache_dirs)
    root = fresh_process_cache_dirs[0].out_dir
    assert unset.returncode == 0 and named.returncode == 0, unset.stderr[-2000:] + named.stderr[-2000:]
    assert unset.stdout.strip() == str(root / "inductor")
    assert named.stdout.strip() == str(root / "mine")


@pytest.mark.skipif(sys.platform != "linux", reason="inductor probes vector ISAs on Linux and Windows only")
def test_the_vector_isa_probe_is_recorded_and_then_trusted(tmp_path):
    """A first probe is recorded; the next process (here: the list's cache cleared) trusts the CPU's flags
    with that record (no build, no child Python) and gets the same list; a record that differs from
    what trusting gives (a probe found fewer) is not trusted: the probe runs and is recorded anew."""
    from torch._inductor import config, cpu_vec_isa
    from phaseflip.graphs.compile import vec_isas
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    with config.patch({"cpp.vec_isa_ok": None}):
        probed = vec_isas(str(tmp_path))
        assert config.cpp.vec_isa_ok is None and probed
        (record,) = (tmp_path / "vec_isa").glob("*.json")
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
        assert vec_isas(str(tmp_path)) == probed and config.cpp.vec_isa_ok is True
        edited = json.loads(record.read_text())
        record.write_text(json.dumps({**edited, "isas": probed[-1:] + ["VecNone"]}))
        config.cpp.vec_isa_ok = None
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
        assert vec_isas(str(tmp_path)) == probed and config.cpp.vec_isa_ok is None
        assert json.loads(record.read_text())["isas"] == probed
    cpu_vec_isa.valid_vec_isa_list.cache_clear()


def test_auto_measures_each_bucket_matches_hf_and_writes_no_kv(tiny_model_dir, compiled_cache, monkeypatch):
    """compile="auto", the default: each probed bucket timed compiled against eager (but the decode buckets
    the fused layers run), the faster kept and replayed, HF's tokens. The model is the next test's (its
    graphs, compiled in this process, serve both: one cold compile for the two)."""
    d = tiny_model_dir("llama", num_layers=6)
    prompts = parity_prompts(384)[:4]
    expected = hf_greedy(d, prompts, 16)
    with _boot(d, "auto", compiled_cache, monkeypatch) as llm:
        kv = llm.ranks.runtime.kv.buffer
        assert torch.count_nonzero(kv) == 0, "compiling and capturing wrote into the KV region"
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        m = llm.inspect()
    ok, _, msg = compare_greedy([o.outputs[0].token_ids for o in outs], expected)
    assert ok, msg
    report = m["ranks"][0]["compile"]["pp"]
    assert set(report["decode"]["buckets"]) == {1, 2, 4} and set(report["prefill"]["buckets"]) == {64}
    fused = report["fused_layers"]["rows"]
    if fused:   # they run these buckets: inductor's step is neither compiled nor timed there, nor its one-row form
        assert fused == 8 and report["fused_layers"]["choice"] == "fused layers"
        for bucket in (1, 2, 4):
            assert report["decode"]["buckets"][bucket] == {"choice": "eager", "reason": choice_module.FUSED_ROWS}
        assert report["gemv"]["reason"] == choice_module.ONE_ROW_UNUSED and report["gemv"]["ms"] is None
    for role in ROLES:
        for bucket, r in report[role]["buckets"].items():
            if fused and role == "decode":
                continue
            assert r["compiled_ms"] > 0 and r["eager_ms"] > 0 and r["first_call_ms"] > 0, (role, bucket)
            gain = 1 - r["compiled_ms"] / r["eager_ms"]
            assert r["choice"] == ("compiled" if gain >= choice_module.MIN_GAIN else "eager"), (role, bucket, r)
    backends = {(s["phase"], s["bucket"]): s["backend"] for s in m["steps"]}
    for bucket, r in report["decode"]["buckets"].items():
        assert backends[("decode", bucket)] == r["choice"], bucket
    assert {backends[("prefill", b)] for b in (64, 128)} == {report["prefill"]["buckets"][64]["choice"]}


def test_one_layer_compiles_once_for_every_layer_and_nothing_compiles_after_boot(tiny_model_dir, compiled_cache,
                                                                                  monkeypatch):
    d = tiny_model_dir("llama", num_layers=6)
    prompts = parity_prompts(384)[:3] + parity_prompts(384)[5:6]  # 1+5+17+100 tokens: the 128-token prefill bucket too
    eight = parity_prompts(384)[4][:8]   # alone: as many tokens as the 8 sequence rows the prefill is bound at
    expected = hf_greedy(d, prompts + [eight], 8)
    # decode buckets 1 and 2 for 4 sequences: a decode of 3 or 4 runs as chunks of the compiled 2-row
    # step (what CUDA graphs do; the CPU's own choice is one uncaptured step, so the test opts it in)
    monkeypatch.setattr(LayoutRunner, "CHUNKED_BACKENDS", ("cuda", "compiled"))
    # and the inputs staged through one host mirror and one copy per step, as on CUDA
    monkeypatch.setattr(runtime_module, "StaticBuffers", functools.partial(StaticBuffers, staged=True))
    with _boot(d, "on", compiled_cache, monkeypatch, decode_buckets=(1, 2)) as llm:
        graphs_at_boot = counters["stats"]["unique_graphs"]
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        # each prompt alone: the compiled prefill over its own token rows (2 for one token), not its
        # bucket's 64 or 128; the 8-token prompt's 8 rows, as many as the 8 sequence rows, must not pass
        # for a decode of 8 sequences and run the fused decode layers (here forced to serve what they can)
        prefill = llm.ranks.runtime.runners["pp"].compile.report["prefill"]
        runs_before = prefill.get("own_rows", {}).get("runs", 0)
        with monkeypatch.context() as forced:
            forced.setattr(fused_layer, "_why_not", lambda dtype, tp_size, plain=True: None)
            alone = [llm.generate([p], greedy, use_tqdm=False)[0] for p in prompts + [eight]]
        runs_alone = prefill["own_rows"]["runs"] - runs_before
        # seeded sampling inside the recorded (compiled, padded, chunked) decode step, against the host
        # sampler on the same engine
        sampled = [SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=i, max_tokens=6, ignore_eos=True,
                                  logprobs=2) for i in range(4)]
        in_step = llm.generate(prompts, sampled, use_tqdm=False)
        finishes = llm.ranks.runtime.sampler.in_step_finishes
        for runner in llm.ranks.runtime.runners.values():
            runner.samples_in_step = False
        on_host = llm.generate(prompts, sampled, use_tqdm=False)
        m = llm.inspect()
        stats = llm.stats()
        buffers = llm.ranks.runtime.buffers
    assert finishes > 0, "no decode step sampled inside the step"
    assert [o.outputs[0].token_ids for o in in_step] == [o.outputs[0].token_ids for o in on_host]
    assert [o.outputs[0].logprobs for o in in_step] == [o.outputs[0].logprobs for o in on_host]
    ok, _, msg = compare_greedy([o.outputs[0].token_ids for o in outs], expected[:4])
    assert ok, msg
    ok, _, msg = compare_greedy([o.outputs[0].token_ids for o in alone], expected)
    assert ok, msg
    own_rows = m["ranks"][0]["compile"]["pp"]["prefill"]["own_rows"]
    # every prompt alone; rows up to linear.SMALL_BATCH may take other product forms than the graph
    # compiled at 64 rows (its guards say whether): those run at SMALL_BATCH + 1
    assert runs_alone == len(alone) and all(r <= SMALL_BATCH for r in own_rows["unserved"]), own_rows
    shown = "\n".join(boot_table(m))
    assert f"steps run over their own token rows, not the bucket's: {own_rows['runs']}" in shown
    assert buffers.staged and buffers.uploads == sum(s["replays"] for s in m["steps"]), "one copy per replay"
    assert stats["chunked_runs"].get("pp:decode", 0) > 0, stats["chunked_runs"]
    assert "pp:decode" not in stats["eager_fallbacks"], stats["eager_fallbacks"]
    # 6 layers, 2 decode buckets, 2 prefill buckets: prefill's layer as one saved graph whatever the
    # number of layers (the first layer too: a zero delta to add), dynamic in the rows;
    # decode's whole step at one row (0/1 specialisation) and at more; each compiled at boot, or loaded
    # where an earlier boot of this model saved it, never at the first long prompt
    saved = {role: m["ranks"][0]["compile"]["pp"][role]["saved_steps"] for role in ROLES}
    graphs = {role: set(s["loaded"]) | set(s["compiled"]) for role, s in saved.items()}
    assert {role: len(g) for role, g in graphs.items()} == {"prefill": 1, "decode": 2}, saved
    # traced in this process at most: those, the LM head for one sampled row, and the two graphs
    # choose_gemv times (one layer's one-row products as reductions and as the eager form: compile="on"
    # compiles the 1-row decode, which takes the form it chooses)
    assert m["ranks"][0]["compile"]["pp"]["gemv"]["ms"] is not None
    assert graphs_at_boot <= 1 + 2 + 1 + 2, graphs_at_boot
    assert counters["stats"]["unique_graphs"] == graphs_at_boot, "a step compiled after boot"
    assert {s["backend"] for s in m["steps"]} == {"compiled"}
    caches = llm.ranks.runtime.compile_caches
    assert all(path.startswith(str(compiled_cache / "compile")) for path in caches.values()), caches


@pytest.mark.slow
def test_two_ranks_compile_both_layouts_and_flip_with_hf_tokens(tiny_model_dir, tmp_path, monkeypatch):
    """A later PP stage's layer reads hidden states of the bucket's size, and TP's layer breaks its graph
    at each all-reduce: with compile="on" both layouts compile at boot and give HF's tokens across
    forced flips."""
    d = tiny_model_dir("llama")
    prompts = parity_prompts(384)[:4]
    expected = hf_greedy(d, prompts, 12)
    monkeypatch.setenv("PHASEFLIP_CACHE", str(tmp_path))
    with LLM(model=str(d), dtype="float32", compile="on", world_size=2, max_num_seqs=4,
             max_num_batched_tokens=128, decode_buckets=(1, 2, 4), prefill_buckets=(64, 128),
             flip_every_steps=2) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        m = llm.inspect()
    ok, _, msg = compare_greedy([o.outputs[0].token_ids for o in outs], expected)
    assert ok, msg
    for rank in m["ranks"]:
        assert set(rank["compile"]) == {"pp", "tp"} and all(
            rank["compile"][lay][role]["choice"] == "compiled" for lay in ("pp", "tp") for role in ROLES), \
            rank["compile"]


def test_auto_on_the_cpu_compiles_no_tensor_parallel_step(tiny_model_dir):
    """compile="auto" on the CPU leaves a tensor-parallel layout's roles eager, saying why, and compiles
    none of them (their graphs would break at each all-reduce and be traced again at every boot)."""
    with LLM(model=str(tiny_model_dir("llama")), dtype="float32", compile="off", max_num_seqs=4,
             max_num_batched_tokens=128, decode_buckets=(1, 2, 4), prefill_buckets=(64, 128)) as llm:
        runner = next(iter(llm.ranks.runtime.runners.values()))
    c = runner.compile
    tp = choice_module.CompileChoice(c.layout, c.step_fn, dataclasses.replace(
        c.state, shard=dataclasses.replace(c.state.shard, tp_size=2)), c.buffers, c.shapes)
    tp.prepare("auto", cuda=False)
    assert tp.compiled_steps == {} and tp.report == {
        role: {"choice": "eager", "reason": choice_module.TP_ON_CPU} for role in ROLES}


def test_auto_on_cuda_keeps_per_bucket_the_faster_graph(tiny_model_dir, monkeypatch):
    """compile="auto" on CUDA chooses per bucket by replaying the compiled and the uncompiled step, each
    captured as a CUDA graph. On the CPU, with the capture and the replay timer stood in for: the
    compiled step loses at decode bucket 2 only, and only there the eager step is kept and reported."""
    with LLM(model=str(tiny_model_dir("llama")), dtype="float32", compile="off", max_num_seqs=4,
             max_num_batched_tokens=128, decode_buckets=(1, 2, 4), prefill_buckets=(64, 128)) as llm:
        runner = next(iter(llm.ranks.runtime.runners.values()))
    compiled = {phase: functools.partial(runner.step_fn) for phase in Phase}   # told apart by identity
    choice = runner.compile
    choice.compiled_steps = compiled
    choice.choices = {(ph.value, b): "compiled" for ph in Phase for b, _ in phase_buckets(runner.shapes, ph)}
    choice.report = {ph.value: {"choice": "compiled"} for ph in Phase}
    captured = []

    def capture(key, fn, buffers, sizes, pool, stream):
        captured.append(key)
        return capture_eager(key, fn, buffers, sizes)

    def replay_ms(step):
        if step.fns["step"] is not compiled[Phase(step.key.phase)]:
            return 2.0
        return 3.0 if step.key == StepKey(runner.layout, "decode", 2) else 1.0
    monkeypatch.setattr(choice_module, "capture_cuda", capture)
    monkeypatch.setattr(choice_module, "time_replays", replay_ms)
    choice.choose_by_replay(pool=object(), stream=None)
    assert len(captured) == 2 * 5   # both steps of every bucket
    assert [b for (role, b), c in choice.choices.items() if c == "eager"] == [2] and \
        choice.choices[("decode", 2)] == "eager"
    decode, prefill = choice.report["decode"], choice.report["prefill"]
    assert decode["choice"] == "per bucket" and prefill["choice"] == "compiled"
    assert decode["buckets"][2] == {"choice": "eager", "compiled_ms": 3.0, "eager_ms": 2.0}
    assert decode["buckets"][4] == {"choice": "compiled", "compiled_ms": 1.0, "eager_ms": 2.0}
