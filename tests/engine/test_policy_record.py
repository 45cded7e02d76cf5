"""The policy's record (engine/policy/record.py): what one run's meters measured seeds the next boot of
the same engine, says so in every priced decision, and a changed key or remeasure starts unpriced."""
import json

from phaseflip import LLM, SamplingParams
from phaseflip.engine.policy.decide import decide
from phaseflip.engine.policy.terms import PolicyConfig
from phaseflip.engine.policy.estimators import Meters, RateEstimator
from phaseflip.engine.policy.record import PolicyRecord
from phaseflip.tools.inspect_cmd import render_text
from tests.engine.test_policy import carried_in_pp

KEY = {"model": "m", "dtype": "float32"}
LAYOUTS = ("pp", "tp")


def measured_meters() -> Meters:
    meters = Meters.unseeded(LAYOUTS, 0.0)
    meters.rates["pp"].observe_step(0, 8, 0.02)
    meters.rates["pp"].observe_step(0, 64, 0.05)
    meters.rates["pp"].observe_step(512, 0, 0.25)
    meters.rates["tp"].observe_step(0, 64, 0.08)
    meters.legs["pp->tp"].observe(0.4)
    return meters


def test_rate_provenance_follows_seeds_until_each_is_measured():
    est = RateEstimator("tp", prefill_tok_s=1000.0, decode_step_s={8: 0.02})
    assert est.reading().provenance == "seed"
    est.observe_step(0, 8, 0.03)
    assert est.reading().provenance == "seed+measured"
    est.observe_step(100, 0, 0.1)
    assert est.reading().provenance == "measured"
    assert RateEstimator("tp").reading().provenance == "unpriced"


def test_a_record_round_trips_the_meters_and_only_for_its_key(tmp_path):
    meters = measured_meters()
    PolicyRecord.load(KEY, LAYOUTS, root=tmp_path).save(meters.seeds())
    again = PolicyRecord.load(dict(KEY), LAYOUTS, root=tmp_path)
    assert again.used and again.made_at is not None
    seeded = Meters.seeded(LAYOUTS, 0.0, again.seeds)
    for layout in LAYOUTS:
        a, b = meters.rates[layout].reading(), seeded.rates[layout].reading()
        assert (a.prefill_tok_s, a.decode_step_s) == (b.prefill_tok_s, b.decode_step_s)
        assert b.provenance in ("seed", "unpriced")
    leg = seeded.legs["pp->tp"].reading()
    assert (leg.seconds, leg.provenance) == (0.4, "seed")
    assert seeded.legs["tp->pp"].reading().provenance == "unpriced"   # never measured: not invented
    assert not PolicyRecord.load({**KEY, "dtype": "bfloat16"}, LAYOUTS, root=tmp_path).used
    assert not PolicyRecord.load(KEY, LAYOUTS, remeasure=True, root=tmp_path).used


def test_an_unusable_record_is_ignored_not_trusted(tmp_path):
    record = PolicyRecord.load(KEY, LAYOUTS, root=tmp_path)
    record.save({"rates": {"pp": {"prefill_tok_s": -5.0, "decode_step_s": {}}}, "legs": {}})
    assert not PolicyRecord.load(KEY, LAYOUTS, root=tmp_path).used
    record.path.write_text(json.dumps({"key": KEY, "rates": {"pp": {"decode_step_s": {"x": 1}}}}))
    assert not PolicyRecord.load(KEY, LAYOUTS, root=tmp_path).used


def test_seeded_rates_price_the_first_decision_and_say_they_are_seeds(tmp_path):
    seeds = Meters.seeded(LAYOUTS, 0.0, measured_meters().seeds())
    rates = {k: e.reading() for k, e in seeds.rates.items()}
    d = decide(carried_in_pp(rates=rates), PolicyConfig())
    assert d.numbers["work_here_s"] is not None and d.numbers["work_there_s"] is not None
    assert d.numbers["rates_provenance"] == {"pp": "seed", "tp": "seed"}


def test_an_engine_keeps_its_policy_measurements_for_the_next_boot(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    kw = dict(model=model, dtype="float32", world_size=2, max_model_len=128, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [f"request {i} " * (4 + i) for i in range(8)]
    with LLM(**kw) as first:
        assert not first.policy_record.used
        expected = [o.outputs[0].token_ids for o in first.generate(prompts, params, use_tqdm=False)]
        path = first.policy_record.path
    kept = json.loads(path.read_text())
    assert kept["rates"]["pp"]["prefill_tok_s"] > 0 and kept["rates"]["pp"]["decode_step_s"]
    with LLM(**kw) as second:
        assert second.policy_record.used and second.inspect()["policy_record"]["path"] == str(path)
        assert f"seeded from the record made {kept['made_at']}" in render_text(second.inspect())
        pp = second.control.rule.meters.rates["pp"].reading()   # before any step: the seeds
        assert (pp.provenance, pp.prefill_tok_s) == ("seed", kept["rates"]["pp"]["prefill_tok_s"])
        outs = second.generate(prompts, params, use_tqdm=False)
        priced = [d for d in second.stats()["decisions"] if "rates_provenance" in d["numbers"]]
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert priced, "a priced decision says where its rates came from"
    with LLM(**{**kw, "remeasure": True}) as third:
        assert not third.policy_record.used
    with LLM(**{**kw, "max_num_seqs": 4}) as other:
        assert not other.policy_record.used and other.policy_record.path != path
    with LLM(**kw, flip_every_steps=2) as forced:   # the drain rule prices nothing: no record read or kept
        assert forced.policy_record is None and forced.inspect()["policy_record"] is None
