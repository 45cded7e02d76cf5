"""The boot record (rank/boot_record.py) and the saved compiled steps (graphs/saved_steps.py): a
second boot with the same key takes its choices from the record, measures nothing and compiles nothing;
a changed key (another dtype, another model) or remeasure=True measures again."""
import os

import pytest
import torch
from torch._dynamo.utils import counters

from phaseflip import LLM, SamplingParams
from phaseflip.graphs import saved_steps
from phaseflip.kernels.cpu import forms, fused_layer
from phaseflip.rank import compile_choice
from phaseflip.rank import boot_record
from phaseflip.rank.boot_record import BootRecord, key_digest

# tests/graphs/test_compiled.py's model and step widths (its saved steps serve these boots) with buckets
# of their own (a record of their own)
SHAPES = dict(max_num_seqs=4, max_num_batched_tokens=128, decode_buckets=(1, 2, 4), prefill_buckets=(64,))
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _stand_in_timer(calls: list):
    """time_alternating with fixed times: compiled faster at decode rows 2 and 4 alone, so the choices do not
    depend on this machine's noise; every call is logged."""
    def timer(fns, views, rounds=5):
        rows = views["input_ids"].shape[0] if "input_ids" in views else 0
        calls.append(rows)
        fast = rows in (2, 4)
        return {"compiled": 1.0 if fast else 2.0, "eager": 2.0 if fast else 1.0}
    return timer


def _boot(d, **kwargs):
    counters.clear()
    return LLM(model=str(d), dtype=kwargs.pop("dtype", "float32"), **SHAPES, **kwargs)


def _forget_measurements(monkeypatch):
    """A fresh process as far as the measured forms go (they are kept per process, dtype and model)."""
    monkeypatch.setattr(forms, "_measured", {})


@pytest.mark.skipif(not saved_steps.available(), reason="this torch cannot save compiled functions "
                    "(torch.compiler.load_compiled_function)")
def test_a_warm_boot_takes_the_record_and_compiles_nothing(tiny_model_dir, compiled_cache, monkeypatch):
    monkeypatch.setenv("PHASEFLIP_CACHE", str(compiled_cache))
    calls: list = []
    monkeypatch.setattr(compile_choice, "time_alternating", _stand_in_timer(calls))
    # the fused layers take 1 row unmeasured, not 4: decode buckets 2 and 4 are measured and compiled
    monkeypatch.setattr(fused_layer, "SURE_ROWS", 1)
    d = tiny_model_dir("llama", num_layers=6)
    prompts = ["one two three", "four five", "six", "seven eight nine ten"]
    with _boot(d, compile="auto") as llm:
        cold = llm.inspect()["ranks"][0]["compile"]["pp"]
        cold_out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert calls and not cold["record"]["used"]
    assert cold["decode"]["choices"] == {1: "eager", 2: "compiled", 4: "compiled"}
    cold_steps = cold["decode"]["saved_steps"]
    assert cold_steps["compiled"] or cold_steps["loaded"], "the cold boot neither saved nor loaded a compiled step"

    calls.clear()
    _forget_measurements(monkeypatch)
    torch._dynamo.reset()   # nothing this process traced serves the warm boot
    with _boot(d, compile="auto") as llm:
        warm = llm.inspect()["ranks"][0]["compile"]["pp"]
        warm_out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        steps = {(s["phase"], s["bucket"]): s["backend"] for s in llm.inspect()["steps"]}
    assert warm["record"]["used"] and warm["record"]["made_at"] == cold["record"]["made_at"]
    assert calls == [], "the warm boot measured"
    assert counters["stats"]["unique_graphs"] == 0, "the warm boot traced a graph"
    assert warm["decode"]["saved_steps"]["compiled"] == [] and warm["decode"]["saved_steps"]["loaded"]
    for what in ("small_rows", "wide_rows", "gemv", "prefill", "decode"):
        assert warm[what]["choice"] == cold[what]["choice"], what
    assert steps[("decode", 1)] == "eager" and steps[("decode", 2)] == steps[("decode", 4)] == "compiled"
    assert warm_out == cold_out


def test_the_record_is_used_by_its_key_alone(tiny_model_dir, tmp_path, monkeypatch):
    """compile="off" (the forms alone are measured): a second boot takes them from the record; another
    dtype, another model, or remeasure=True measures them again."""
    monkeypatch.setenv("PHASEFLIP_CACHE", str(tmp_path))

    def boot(d, **kwargs):
        _forget_measurements(monkeypatch)
        with _boot(d, compile="off", **kwargs) as llm:
            return llm.inspect()["ranks"][0]["compile"]["pp"]

    llama, qwen = tiny_model_dir("llama"), tiny_model_dir("qwen2")
    first = boot(llama)
    assert not first["record"]["used"] and first["small_rows"]["ms"]
    again = boot(llama)
    assert again["record"]["used"] and again["small_rows"] == first["small_rows"]
    for other in (boot(llama, dtype="bfloat16"), boot(qwen), boot(llama, remeasure=True)):
        assert not other["record"]["used"] and other["small_rows"]["ms"]
    assert boot(llama)["record"]["used"]


def test_a_record_of_another_key_is_not_read(tmp_path):
    key = {"model": "a", "dtype": "torch.float32"}
    BootRecord.load(key, root=tmp_path).save({"small_rows": {"choice": "x", "forms": {1: "kernel"}}})
    loaded = BootRecord.load(key, root=tmp_path)
    assert loaded.get("small_rows") == {"choice": "x", "forms": {1: "kernel"}}   # int row counts come back
    assert BootRecord.load({**key, "dtype": "torch.bfloat16"}, root=tmp_path).reports == {}
    assert BootRecord.load(key, remeasure=True, root=tmp_path).reports == {}
    # a file whose key does not match its name's (a digest collision, or edited) is not trusted
    (tmp_path / f"{key_digest(key)}.json").write_text('{"key": {"model": "b"}, "reports": {"x": {}}}')
    assert BootRecord.load(key, root=tmp_path).reports == {}


def test_the_cache_keeps_the_most_recently_used_records_and_steps(tmp_path, monkeypatch):
    """Every source edit makes new keys: saving a record prunes the records and saved-step directories
    to the most recently used (a loaded record and its steps count as used), never the one just saved."""
    root = tmp_path / "records"
    records = []
    for i in range(5):   # records 0..4, each with its steps, 0 the least recently used
        record = BootRecord.load({"model": f"m{i}"}, root=root)
        record.save({"small_rows": {"choice": "x"}})
        record.steps_dir.mkdir(parents=True)
        (record.steps_dir / "graph").write_text("saved")
        for path in (record.path, record.steps_dir):
            os.utime(path, (1000 + i, 1000 + i))
        records.append(record)
    monkeypatch.setattr(boot_record, "KEEP_RECORDS", 3)
    monkeypatch.setattr(boot_record, "KEEP_STEPS", 2)
    assert BootRecord.load({"model": "m0"}, root=root).reports   # m0 used again: now the newest
    newest = BootRecord.load({"model": "m5"}, root=root)
    newest.save({"small_rows": {"choice": "y"}})
    kept = sorted(p.stem for p in root.glob("*.json"))
    assert kept == sorted(key_digest({"model": m}) for m in ("m5", "m0", "m4"))
    steps = sorted(p.name for p in newest.steps_dir.parent.iterdir())
    assert steps == sorted(r.steps_dir.name for r in (records[0], records[4]))   # m5 saved none yet
