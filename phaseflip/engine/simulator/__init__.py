"""The layout policy on a modelled rig (no torch): the same decide.py the engine runs, fed by a step model.

run.py    the step model and `simulate` (SimResult; static_decide for the static-layout rows)
rig.py    rig profiles (JSON; every number labelled measured / derived / assumption)
trace.py  arrival traces (JSONL)
"""
