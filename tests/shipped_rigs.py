"""The policy simulator's rows for a shipped rig on the shipped trace (`phaseflip simulate`'s own
computation, 8 simulated runs a rig), computed once a session: tests/engine/test_simulator.py holds the
acceptance to them and tests/tools/test_simulate.py has the command print them."""
from __future__ import annotations

import functools

from phaseflip.engine.simulator import rig as sim_rig, trace as sim_trace
from phaseflip.tools.simulate import compare   # bound here: a test may stand in for the command's

TRACE = "mixed-trace.jsonl"


@functools.lru_cache(maxsize=None)
def rows(rig_name: str, ttft_budget_s: float) -> tuple:
    """(rig, rows of simulate.compare) for the shipped rig `rig_name` on the shipped trace."""
    rig = sim_rig.load_rig(rig_name)
    return rig, compare(rig, sim_trace.load_trace(TRACE), ttft_budget_s)
