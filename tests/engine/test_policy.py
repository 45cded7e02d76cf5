"""The layout policy (engine/policy/decide.py, terms.py and estimators.py): estimators, counters, configuration,
and the scenarios a pure decision can show (frozen-pending wedge, ping-pong,
per-leg pricing, a hold's bound). Each scenario also runs a naive rule, defined here, and shows it fails
the same scenario."""
import random
import subprocess
import sys

import pytest

from phaseflip.engine.policy.decide import decide
from phaseflip.engine.policy.terms import Decision, PolicyConfig, PolicyInputs
from phaseflip.engine.policy.estimators import (FlipCostEstimator, LayoutRates, LegCost, OutputLengthEstimator,
                                                ProgressTracker, RateEstimator, round_trip)

RATES = {"pp": LayoutRates("pp", 4000.0, ((1, 0.040), (64, 0.060))),
         "tp": LayoutRates("tp", 1500.0, ((1, 0.012), (64, 0.020)))}


def legs(out_s=1.0, back_s=1.0, provenance="measured"):
    return {"pp->tp": LegCost("pp->tp", out_s, out_s, provenance, 1),
            "tp->pp": LegCost("tp->pp", back_s, back_s, provenance, 1)}


def inputs(tracker=None, **kw):
    """A decision's inputs; defaults: in PP, nothing to do, the module's rates, 1 s legs."""
    base = dict(active="pp", now_s=10.0, pending_prefill_tokens=0, admissible_prefill_tokens=0,
                fillable_prefill_tokens=None, num_waiting=0, num_running=0, num_carried_decodes=0,
                carried_decode_tokens=0, free_kv_blocks=100, bundle_kv_blocks=0, oldest_wait_s=None,
                progress=None, rates=RATES, legs=legs())
    base.update(kw)
    if base["fillable_prefill_tokens"] is None:
        base["fillable_prefill_tokens"] = base["pending_prefill_tokens"]
    if base["progress"] is None:
        base["progress"] = (tracker or settled_tracker()).snapshot()
    return PolicyInputs(**base)


def settled_tracker(since_s=0.0, polls=10):
    tracker = ProgressTracker(since_s)
    for _ in range(polls):
        tracker.on_poll(since_s, 1, 1, 0, 0)
    return tracker


def carried_in_pp(**kw):
    """PP with 8 carried decodes worth ~14 s more in PP than in TP (a round trip is 2 s)."""
    base = dict(active="pp", num_running=8, num_carried_decodes=8, carried_decode_tokens=8 * 500)
    base.update(kw)
    return inputs(**base)


# -- import hygiene ---------------------------------------------------------------------------------
def test_importing_policy_and_simulator_loads_no_torch():
    code = ("import sys, phaseflip.engine.policy.rules, phaseflip.engine.simulator.run; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- flip cost per direction (the two directions cost differently) ----------------------------------
def blended_ema_price(totals, alpha=0.3):
    """The naive estimator: ONE EMA fed both directions, read as the round-trip price."""
    ema = None
    for t in totals:
        ema = t if ema is None else ema + alpha * (t - ema)
    return ema


def test_per_leg_pricing_sums_the_legs_and_provenance_follows_the_legs():
    out, back = FlipCostEstimator("pp->tp", seed_s=3.0), FlipCostEstimator("tp->pp", seed_s=3.0)
    trip = round_trip(out.reading(), back.reading())
    assert (trip.seconds, trip.provenance) == (6.0, "seed")
    out.observe(11.5)
    trip = round_trip(out.reading(), back.reading())
    assert (trip.seconds, trip.provenance) == (14.5, "half-measured")
    back.observe(6.4)
    trip = round_trip(out.reading(), back.reading())
    assert trip.seconds == pytest.approx(17.9) and trip.provenance == "measured"
    for _ in range(10):   # the legs keep arriving alternately: the price stays their sum
        out.observe(11.5)
        back.observe(6.4)
    assert round_trip(out.reading(), back.reading()).seconds == pytest.approx(17.9)


def test_naive_blended_estimator_misprices_the_same_legs():
    naive = blended_ema_price([11.5, 6.4] * 11)
    assert abs(naive - 17.9) > 7          # converged to neither leg, priced at about half the trip
    saving = 12.0                          # a flip that saves 12 s against a 17.9 s round trip
    per_leg = decide(carried_in_pp(legs=legs(11.5, 6.4)), PolicyConfig())
    assert per_leg.action == "stay" and per_leg.numbers["round_trip_s"] == pytest.approx(17.9)
    assert saving < 17.9 and saving > naive   # the naive price would have flipped at a loss


def test_unmeasured_leg_is_none_never_zero():
    leg = FlipCostEstimator("pp->tp").reading()
    assert leg.seconds is None and leg.provenance == "unpriced"
    trip = round_trip(leg, FlipCostEstimator("tp->pp", seed_s=2.0).reading())
    assert trip.seconds is None and trip.provenance == "unpriced"


def test_leg_is_the_median_of_its_window_and_high_is_its_worst():
    est = FlipCostEstimator("pp->tp", seed_s=3.0, window=3)
    for t in (1.0, 9.0, 2.0, 3.0):
        est.observe(t)
    reading = est.reading()
    assert (reading.seconds, reading.high_s, reading.num_measured) == (3.0, 9.0, 3)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True])
def test_flip_cost_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        FlipCostEstimator("pp->tp", seed_s=bad)
    with pytest.raises(ValueError):
        FlipCostEstimator("pp->tp").observe(bad)


# -- rates and output lengths --------------------------------------------------------------------------
def test_layout_rates_interpolate_and_never_extrapolate_below_measured():
    rates = LayoutRates("tp", 1000.0, ((1, 0.010), (9, 0.018)))
    assert rates.step_s(1) == 0.010 and rates.step_s(5) == pytest.approx(0.014)
    assert rates.step_s(18) == pytest.approx(0.027)       # the last segment's slope above the largest
    assert LayoutRates("tp", None, ((1, 0.010), (9, 0.008))).step_s(18) == 0.008   # never below it
    one = LayoutRates("tp", None, ((1, 0.010),))
    assert one.step_s(1) == 0.010 and one.step_s(2) is None   # one batch: no slope measured
    assert rates.decode_s(90, 9) == pytest.approx(10 * 0.018)
    assert rates.prefill_s(500) == 0.5
    unmeasured = LayoutRates("tp", None)
    assert unmeasured.step_s(4) is None and unmeasured.prefill_s(10) is None


def test_rate_estimator_learns_pure_steps_and_ignores_mixed_ones():
    est = RateEstimator("pp", prefill_tok_s=1000.0, decode_step_s={8: 0.02}, alpha=0.5)
    est.observe_step(512, 0, 0.256)        # 2000 tok/s
    est.observe_step(0, 8, 0.04)
    est.observe_step(100, 4, 1.0)          # mixed: teaches nothing
    reading = est.reading()
    assert reading.prefill_tok_s == pytest.approx(1500.0)
    assert reading.decode_step_s == ((8, pytest.approx(0.03)),)


def test_output_length_estimator_bounds_by_max_tokens_until_measured():
    est = OutputLengthEstimator()
    assert est.expected_left(10, 100) == 90
    for n in (20, 40, 60, 400):
        est.observe(n)
    assert est.expected_left(0, 100) == round((20 + 40 + 60 + 100) / 4)
    assert est.expected_left(30, 1000) == round((40 + 60 + 400) / 3) - 30
    assert est.expected_left(500, 600) == 100        # nothing longer measured: the bound


# -- configuration and inputs ------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="fast"), "mode"),
    (dict(mode="latency"), "ttft_budget_s"),
    (dict(mode="latency", ttft_budget_s=0), "ttft_budget_s"),
    (dict(ttft_budget_s=5.0), "latency"),
    (dict(stall_polls=0), "stall_polls"),
    (dict(min_dwell_s=-1), "min_dwell_s"),
    (dict(hold_gain=0.5), "hold_gain"),
    (dict(thin_fraction=1.0), "thin_fraction"),
    (dict(prefill_layout="tp"), "differ"),
])
def test_policy_config_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolicyConfig(**kwargs)


def test_policy_config_rejects_unknown_options_by_name():
    with pytest.raises(TypeError, match="ttft_budget"):
        PolicyConfig(ttft_budget=3)


def test_policy_inputs_validate():
    with pytest.raises(ValueError, match="admissible"):
        inputs(pending_prefill_tokens=5, admissible_prefill_tokens=9, fillable_prefill_tokens=9)
    with pytest.raises(ValueError, match="num_carried_decodes"):
        inputs(num_running=1, num_carried_decodes=2)
    with pytest.raises(ValueError, match="free_kv_blocks"):
        inputs(free_kv_blocks=-1)
    with pytest.raises(ValueError, match="active layout"):
        decide(inputs(active="ep"), PolicyConfig())


# -- rules ----------------------------------------------------------------------------------------------
def test_drain_prefills_first_then_sends_the_bundle_when_it_pays():
    busy = decide(carried_in_pp(pending_prefill_tokens=4096, admissible_prefill_tokens=4096), PolicyConfig())
    assert (busy.action, busy.prefill, busy.decode) == ("stay", True, False)
    assert busy.reason == "drain: prefill first"
    drained = decide(carried_in_pp(), PolicyConfig())
    assert (drained.action, drained.target, drained.reason) == ("flip", "tp", "drained")
    assert drained.numbers["saving_s"] > drained.numbers["bar_s"] == drained.numbers["round_trip_s"] == 2.0


def test_the_bar_applied_is_the_bar_logged():
    """One value (the bar applied is the bar logged): a saving just under it stays, just over it flips."""
    probe = decide(carried_in_pp(), PolicyConfig())
    saving = probe.numbers["saving_s"]
    for rt, action in ((saving / 2 + 1e-6, "stay"), (saving / 2 - 1e-6, "flip")):
        d = decide(carried_in_pp(legs=legs(rt, rt)), PolicyConfig())
        assert d.action == action and d.numbers["bar_s"] == pytest.approx(2 * rt)
        assert d.record(carried_in_pp())["numbers"]["bar_s"] == d.numbers["bar_s"]


def test_below_break_even_runs_the_work_here():
    d = decide(carried_in_pp(legs=legs(30.0, 30.0)), PolicyConfig())
    assert (d.action, d.prefill, d.decode) == ("stay", True, True)
    assert d.reason == "drained: below break-even, run here"


def test_unpriced_round_trip_follows_the_drain_rule_and_logs_none():
    d = decide(carried_in_pp(legs={}), PolicyConfig())
    assert d.action == "flip" and d.reason == "drained (unpriced)"
    assert d.numbers["round_trip_s"] is None and d.numbers["round_trip_provenance"] == "unpriced"


def test_prefill_layout_prices_its_own_decode_before_sending_the_bundle():
    """Drained with PP's decode never measured: decode here first (one pure decode step prices it), so the
    bundle is not sent to TP on the home-layout rule alone; prefill still waiting keeps the drain rule."""
    unmeasured = {"pp": LayoutRates("pp", 4000.0), "tp": RATES["tp"]}
    d = decide(carried_in_pp(rates=unmeasured), PolicyConfig())
    assert (d.action, d.reason, d.prefill, d.decode) == ("stay", "measure decode here", False, True)
    assert d.numbers["work_here_s"] is None and d.numbers["work_there_s"] > 0
    busy = decide(carried_in_pp(rates=unmeasured, pending_prefill_tokens=4096, admissible_prefill_tokens=4096),
                  PolicyConfig())
    assert busy.reason == "drain: prefill first"


SLOW_TP = {"pp": LayoutRates("pp", 4000.0, ((1, 0.012), (64, 0.020))),
           "tp": LayoutRates("tp", 1500.0, ((1, 0.040), (64, 0.060)))}


def test_decode_layout_sends_the_bundle_back_where_it_was_measured_faster():
    """A rig whose TP collectives cost more than they save (gloo on CPU cores): once both decode rates are
    measured, a bundle that decodes faster in PP by more than a round trip goes back; within the bar,
    or unpriced, it stays home."""
    in_tp = dict(active="tp", num_running=8, num_carried_decodes=8, carried_decode_tokens=8 * 500)
    d = decide(inputs(rates=SLOW_TP, **in_tp), PolicyConfig())
    assert (d.action, d.target, d.reason) == ("flip", "pp", "decode cheaper there")
    assert d.numbers["saving_s"] > d.numbers["round_trip_s"] == 2.0
    assert decide(inputs(rates=SLOW_TP, legs=legs(10.0, 10.0), **in_tp), PolicyConfig()).reason == "decode"
    unmeasured = {"pp": LayoutRates("pp", 4000.0), "tp": SLOW_TP["tp"]}
    d = decide(inputs(rates=unmeasured, **in_tp), PolicyConfig())
    assert (d.action, d.reason) == ("stay", "decode") and d.numbers["saving_s"] is None
    assert decide(inputs(**in_tp), PolicyConfig()).reason == "decode"   # TP faster: home


def test_prefill_layout_decodes_alongside_prefill_where_the_bundle_is_not_faster_there():
    """Prefill waiting, and the carried bundle measured decoding here no slower than there: holding it back
    for a flip gains nothing, so its decodes ride the prefill steps; measured faster there (or unmeasured),
    the drain rule holds them for the flip."""
    busy = dict(pending_prefill_tokens=4096, admissible_prefill_tokens=4096)
    d = decide(carried_in_pp(rates=SLOW_TP, **busy), PolicyConfig())
    assert (d.action, d.reason, d.prefill, d.decode) == ("stay", "prefill, decode here: not faster there", True, True)
    assert d.numbers["work_here_s"] <= d.numbers["work_there_s"]
    assert decide(carried_in_pp(**busy), PolicyConfig()).reason == "drain: prefill first"
    unmeasured = {"pp": SLOW_TP["pp"], "tp": LayoutRates("tp", 1500.0)}
    assert decide(carried_in_pp(rates=unmeasured, **busy), PolicyConfig()).reason == "drain: prefill first"


def test_one_measured_leg_prices_its_unmeasured_return():
    """After the first flip only its own direction is measured: the way back is priced by it (mirrored),
    so the bundle can return on the bar a round trip sets; a seed or nothing measured stays unpriced."""
    in_tp = dict(active="tp", num_running=8, num_carried_decodes=8, carried_decode_tokens=8 * 500)
    one_leg = {"pp->tp": LegCost("pp->tp", 0.6, 0.7, "measured", 1)}
    d = decide(inputs(rates=SLOW_TP, legs=one_leg, **in_tp), PolicyConfig())
    assert (d.action, d.reason) == ("flip", "decode cheaper there")
    assert d.numbers["round_trip_s"] == pytest.approx(1.2) and d.numbers["round_trip_provenance"] == "half-measured"
    seeded = {"pp->tp": LegCost("pp->tp", 0.6, 0.6, "seed", 0)}
    d = decide(inputs(rates=SLOW_TP, legs=seeded, **in_tp), PolicyConfig())
    assert (d.reason, d.numbers["round_trip_s"]) == ("decode", None)


def test_min_dwell_vetoes_economic_flips_not_the_starvation_backstop():
    tracker = ProgressTracker(9.8)
    tracker.on_poll(9.8, 0, 0, 8, 0)
    tracker.on_poll(9.9, 0, 0, 8, 0)
    held = decide(carried_in_pp(tracker=tracker), PolicyConfig(min_dwell_s=1.0))
    assert held.action == "stay" and "min dwell" in held.reason and held.decode
    tracker = ProgressTracker(0.0)
    tracker.on_poll(0.0, 512, 0, 8, 512)       # decodes carried and waiting since t=0
    tracker.on_cutover(9.9)
    for _ in range(3):
        tracker.on_poll(9.95, 512, 0, 8, 512)
    starved = decide(carried_in_pp(tracker=tracker, now_s=61.0, pending_prefill_tokens=9000,
                                   admissible_prefill_tokens=4096), PolicyConfig(min_dwell_s=100.0))
    assert (starved.action, starved.reason) == ("flip", "decode-starved")
    assert starved.numbers["decode_wait_s"] >= starved.numbers["max_decode_wait_s"]


def test_decode_layout_holds_prefill_back_then_returns_when_it_pays():
    cfg = PolicyConfig()
    tracker = settled_tracker(polls=0)
    tracker.on_poll(0.0, 0, 1, 64, 0)          # the bundle's peak batch: 64
    tracker.on_poll(0.0, 0, 1, 64, 0)
    small = decide(inputs(tracker=tracker, active="tp", num_running=60, num_carried_decodes=60,
                          pending_prefill_tokens=400_000, admissible_prefill_tokens=2000), cfg)
    assert (small.action, small.prefill, small.decode) == ("stay", False, True)
    assert small.reason == "drain: decode the bundle"
    big = decide(inputs(tracker=tracker, active="tp", num_running=60, num_carried_decodes=60,
                        pending_prefill_tokens=400_000, admissible_prefill_tokens=20_000), cfg)
    assert (big.action, big.reason) == ("flip", "prefill waits")
    assert big.numbers["saving_s"] > big.numbers["bar_s"] == cfg.hold_gain * 2.0


def test_decode_layout_prefills_here_when_holding_cannot_pay():
    d = decide(inputs(active="tp", num_running=60, num_carried_decodes=60, pending_prefill_tokens=3000,
                      admissible_prefill_tokens=3000), PolicyConfig())
    assert (d.action, d.prefill, d.decode) == ("stay", True, True)
    assert d.reason == "holding cannot pay: below break-even, run here"


def test_latency_mode_leaves_at_the_oldest_prompts_deadline():
    cfg = PolicyConfig(mode="latency", ttft_budget_s=8.0)
    base = dict(active="tp", num_running=60, num_carried_decodes=60, pending_prefill_tokens=400_000,
                admissible_prefill_tokens=4000)
    early = decide(inputs(oldest_wait_s=1.0, **base), cfg)
    assert early.action == "stay" and not early.prefill
    late = decide(inputs(oldest_wait_s=6.0, **base), cfg)
    assert (late.action, late.reason) == ("flip", "ttft-deadline")
    n = late.numbers
    assert n["bar_s"] == pytest.approx(8.0 - n["leg_high_s"] - n["queue_there_s"]) and n["oldest_wait_s"] >= n["bar_s"]


def test_latency_deadline_after_the_first_flip_prices_the_way_back_by_its_opposite():
    """Only pp->tp measured (the first flip): the deadline's leg back is that flip's worst total, marked
    mirrored, so the deadline is priced; with nothing measured it is unpriced and leaves at the budget."""
    cfg = PolicyConfig(mode="latency", ttft_budget_s=8.0)
    base = dict(active="tp", num_running=60, num_carried_decodes=60, pending_prefill_tokens=400_000,
                admissible_prefill_tokens=4000, oldest_wait_s=6.5)
    d = decide(inputs(legs={"pp->tp": LegCost("pp->tp", 0.6, 0.9, "measured", 1)}, **base), cfg)
    assert (d.action, d.reason) == ("flip", "ttft-deadline")
    assert (d.numbers["leg_high_s"], d.numbers["leg_provenance"]) == (0.9, "mirrored")
    d = decide(inputs(legs={}, **base), cfg)
    assert (d.action, d.reason, d.numbers["leg_high_s"]) == ("flip", "ttft-deadline (unpriced)", None)


def test_latency_mode_prefills_here_when_no_cycle_fits_the_budget():
    cfg = PolicyConfig(mode="latency", ttft_budget_s=8.0)
    d = decide(inputs(active="tp", num_running=60, num_carried_decodes=60, pending_prefill_tokens=600,
                      admissible_prefill_tokens=600, oldest_wait_s=1.0, legs=legs(10.0, 10.0)), cfg)
    assert (d.action, d.prefill) == ("stay", True) and d.reason == "ttft-deadline: prefill here is sooner"


def test_never_idle_with_work_pending_over_random_inputs():
    """A stay always opens a phase that has work, whenever some work can run (never a wedge)."""
    rng = random.Random(0)
    cfgs = (PolicyConfig(), PolicyConfig(mode="latency", ttft_budget_s=5.0))
    for _ in range(3000):
        tracker = ProgressTracker(0.0)
        for _ in range(rng.randrange(6)):
            tracker.on_poll(rng.uniform(0, 5), rng.choice((0, 64)), rng.choice((0, 8)), rng.randrange(9),
                            rng.choice((0, 512)))
        if rng.random() < 0.2:
            tracker.on_flip_failed()
        running = rng.randrange(20)
        carried = rng.randrange(running + 1)
        pending = rng.choice((0, 0, 100, 5000, 100_000))
        admissible = rng.choice((0, pending // 2, pending))
        w = inputs(tracker=tracker, active=rng.choice(("pp", "tp")), now_s=rng.uniform(5, 200),
                   pending_prefill_tokens=pending, admissible_prefill_tokens=admissible,
                   num_running=running, num_carried_decodes=carried, carried_decode_tokens=carried * 100,
                   oldest_wait_s=rng.choice((None, 1.0, 50.0)),
                   legs=rng.choice((legs(), legs(40.0, 40.0), {})))
        d = decide(w, rng.choice(cfgs))
        if d.action == "stay" and (admissible or carried):
            assert (d.prefill and admissible) or (d.decode and carried), (w, d)


# -- acceptance: the frozen-pending wedge (every exit from a wedge must be reachable) ----------------
def naive_wait_for_pending(w: PolicyInputs) -> bool:
    """Leave PP only once the backlog has drained: waits for an event that can no longer happen."""
    return w.pending_prefill_tokens == 0


def naive_timer(w: PolicyInputs, since_s: float, limit_s: float = 5.0) -> bool:
    """Leave PP after limit_s with decodes carried: a timer, not progress."""
    return w.num_carried_decodes > 0 and w.now_s - since_s >= limit_s


def replay_pp(prefill_every: int | None, polls: int, dt: float = 0.05):
    """PP for a while; carried decodes hold every slot; the caller's counter still promises an admissible
    chunk (a counter promising what the actuator cannot pay). Yields
    (poll, inputs, decision); prefill_every=None: nothing is ever admitted (frozen), else one token per
    window of that many polls (a slow but real drain)."""
    tracker, pending = ProgressTracker(-10.0), 5000     # in PP for a while: past settle and min dwell
    for poll in range(polls):
        w = carried_in_pp(tracker=tracker, now_s=poll * dt, pending_prefill_tokens=pending,
                          admissible_prefill_tokens=512)
        yield poll, w, decide(w, PolicyConfig())
        step = 1 if prefill_every and poll % prefill_every == prefill_every - 1 else 0
        pending -= step
        tracker.on_poll(poll * dt, step, 0, 8, 512)


def test_frozen_pending_wedge_leaves_within_k_chunk_cadences():
    k = PolicyConfig().stall_polls
    flips = [(poll, d) for poll, _, d in replay_pp(None, 100) if d.action == "flip"]
    poll, d = flips[0]
    assert poll <= k and d.reason == "stalled" and d.target == "tp"
    assert d.numbers["polls_without_prefill"] >= d.numbers["stall_polls"] == k


def test_frozen_pending_wedge_holds_the_naive_rule_forever():
    assert not any(naive_wait_for_pending(w) for _, w, _ in replay_pp(None, 1000))


def test_slow_real_drain_never_trips_the_progress_exit():
    k = PolicyConfig().stall_polls
    decisions = [d for _, _, d in replay_pp(k - 1, 300)]      # 15 s, one token per window
    assert all(d.action == "stay" for d in decisions)
    assert not any("stalled" in d.reason for d in decisions)


def test_slow_real_drain_trips_the_naive_timer():
    assert any(naive_timer(w, since_s=0.0) for _, w, _ in replay_pp(PolicyConfig().stall_polls - 1, 300))


# -- acceptance: ping-pong right after cutovers (judge a layout only after it could run) -------------
def arms_after_cutovers(settled_index: int = 7):
    """12 alternating arms, each right after a cutover: PP looks drained (decodes carried, no prefill),
    TP looks drained (no decodes, prefill waiting). Only arm `settled_index` comes after its layout
    settled (its settle polls and min dwell passed)."""
    for i in range(12):
        t = 10.0 * i
        tracker = ProgressTracker(0.0)
        tracker.on_cutover(t)
        settled = i == settled_index
        for _ in range(PolicyConfig().settle_polls if settled else i % 2):
            tracker.on_poll(t, 0, 0, 0, 0)
        now = t + (1.0 if settled else 0.01)
        if i % 2 == 0:
            yield i, carried_in_pp(tracker=tracker, now_s=now)
        else:
            yield i, inputs(tracker=tracker, now_s=now, active="tp", pending_prefill_tokens=20_000,
                            admissible_prefill_tokens=20_000, num_waiting=20)


def naive_flip_when_home_phase_is_empty(w: PolicyInputs) -> bool:
    if w.active == "pp":
        return w.admissible_prefill_tokens == 0 and w.num_carried_decodes > 0
    return w.num_carried_decodes == 0 and w.pending_prefill_tokens > 0


def test_ping_pong_arms_at_most_one_in_twelve_the_settled_one():
    armed = [i for i, w in arms_after_cutovers() if decide(w, PolicyConfig()).action == "flip"]
    assert armed == [7]
    reasons = {decide(w, PolicyConfig()).reason for i, w in arms_after_cutovers() if i != 7}
    assert reasons <= {"settle", "settle (+open: nothing else runs here)"}


def test_ping_pong_arms_every_time_under_the_naive_rule():
    assert sum(naive_flip_when_home_phase_is_empty(w) for _, w in arms_after_cutovers()) == 12


# -- acceptance: a hold's counter advances and its bound releases ------------------------------------
def test_failed_flip_hold_is_bounded_by_a_counter_that_advances():
    cfg, tracker = PolicyConfig(), settled_tracker()
    tracker.on_flip_failed()
    for poll in range(cfg.failed_flip_backoff_polls):
        d = decide(carried_in_pp(tracker=tracker), cfg)
        assert (d.action, d.reason, d.prefill, d.decode) == ("stay", "flip failed: run here", True, True)
        assert d.numbers["polls_since_failed_flip"] == poll < d.numbers["bound_polls"]
        tracker.on_poll(10.0, 0, 8, 8, 0)
    assert decide(carried_in_pp(tracker=tracker), cfg).action == "flip"
    tracker.on_flip_failed()                   # a second failure doubles the bound
    held = [decide(carried_in_pp(tracker=tracker), cfg) for _ in range(1)]
    assert held[0].numbers["bound_polls"] == 2 * cfg.failed_flip_backoff_polls
    tracker.on_cutover(20.0)                   # a successful flip clears the failures
    assert tracker.snapshot().failed_flips_in_row == 0


def test_settle_hold_releases_after_its_polls():
    tracker = ProgressTracker(0.0)
    tracker.on_cutover(5.0)
    seen = []
    for _ in range(4):
        seen.append(decide(carried_in_pp(tracker=tracker), PolicyConfig()).reason)
        tracker.on_poll(5.0, 0, 0, 8, 0)
    assert seen[:2] == ["settle (+open: nothing else runs here)"] * 2 and seen[2] == "drained"


class NaiveHold:
    """The bug: a hold whose counter only a flip writes back, so nothing advances it while held."""

    def __init__(self, bound: int = 8):
        self.bound, self.polls_since_failure, self.failed = bound, 0, False

    def on_flip(self, ok: bool) -> None:
        self.failed = not ok
        self.polls_since_failure = 0

    def decide(self, w: PolicyInputs) -> str:
        return "hold" if self.failed and self.polls_since_failure < self.bound else "flip"


def test_naive_hold_never_releases():
    naive = NaiveHold()
    naive.on_flip(ok=False)
    assert all(naive.decide(carried_in_pp()) == "hold" for _ in range(1000))


def test_decision_record_carries_time_layout_action_reason_numbers():
    w = carried_in_pp()
    record = decide(w, PolicyConfig()).record(w)
    assert set(record) >= {"time_s", "layout", "action", "target", "reason", "numbers"}
    assert record["time_s"] == 10.0 and record["layout"] == "pp" and isinstance(record["numbers"], dict)
    assert isinstance(Decision("stay", "pp", "x", True, False).numbers, dict)
