"""The flip log (engine/policy/control.py) and the policy's decision log (engine/policy/rules.py) keep
only their newest records over a long run, while the counts stay exact. Plain Python: no model, no
ranks (a fake rank group answers the flips)."""
from phaseflip.engine.blocks import BlockAllocator
from phaseflip.engine.policy.control import MAX_FLIP_LOG, LayoutControl
from phaseflip.engine.policy.terms import PolicyConfig
from phaseflip.engine.policy.rules import MAX_DECISIONS, DrainRule, PolicyRule
from phaseflip.engine.scheduler import Scheduler, SchedulerConfig
from phaseflip.rank.messages import FLIP_STAGES, FlipCommand, FlipReport
from phaseflip.tools.inspect_cmd import flips_table


class FakeRanks:
    """Two ranks that answer every flip; every third flip fails at 'exchange' on rank 1 (rolled
    back). kv_bytes carries the flip's number, so the log shows which flips it kept."""
    world_size = 2

    def __init__(self):
        self.num_calls = 0

    def call(self, msg) -> list:
        assert isinstance(msg, FlipCommand)
        self.num_calls += 1
        fails = self.num_calls % 3 == 0
        return [FlipReport(rank=r, source="?", target=msg.target, ok=not (fails and r == 1),
                           failed_stage="exchange" if fails and r == 1 else None,
                           error="boom" if fails and r == 1 else None,
                           ms={**dict.fromkeys(FLIP_STAGES, 1.0), "total": 5.0}, kv_bytes=self.num_calls)
                for r in range(self.world_size)]


def test_flip_log_keeps_the_newest_flips_and_exact_counts():
    num_calls = 3 * MAX_FLIP_LOG + 7
    control = LayoutControl(FakeRanks(), ("pp", "tp"), DrainRule(("pp", "tp")), list)
    for _ in range(num_calls):
        control.flip(control.other())
    assert len(control.flip_log) == MAX_FLIP_LOG
    assert control.num_failed_flips == num_calls // 3
    assert control.num_flips == num_calls - num_calls // 3
    kept = [e["kv_bytes"] // 2 for e in control.flip_log]  # both ranks report the flip's number
    assert kept == list(range(num_calls - MAX_FLIP_LOG + 1, num_calls + 1))
    assert [e["ok"] for e in control.flip_log] == [n % 3 != 0 for n in kept]
    manifest = {"flips": list(control.flip_log), "num_flips": control.num_flips,
                "num_failed_flips": control.num_failed_flips}
    assert flips_table(manifest)[0] == f"flips (the last {MAX_FLIP_LOG} of {num_calls}):"


def test_decision_log_keeps_the_newest_records_and_counts_them_all():
    allocator = BlockAllocator(num_blocks=16, block_size=8)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=64,
                                          block_size=8), allocator)
    rule = PolicyRule(PolicyConfig(), ("pp", "tp"), scheduler, max_model_len=64)
    num_records = 2 * MAX_DECISIONS + 5
    layouts = ["pp" if i % 2 == 0 else "tp" for i in range(num_records)]
    for layout in layouts:  # a new layout every call: a new record every call
        rule.decide(layout)
    rule.decide(layouts[-1])  # a repeat only bumps the last record's count
    assert len(rule.decisions) == MAX_DECISIONS
    assert rule.num_decisions == num_records
    assert rule.decisions[-1]["count"] == 2 and rule.decisions[0]["count"] == 1
    control = LayoutControl(FakeRanks(), ("pp", "tp"), rule, list)
    assert control.last_decisions(2) == list(rule.decisions)[-2:]

