"""The layout policy: which captured layout runs next, and when to flip (no torch anywhere here).

control.py   LayoutControl: carries a rule's answers out (flips, the flip log) and feeds it what flips measured
rules.py     the Rule interface and its two implementations (the drain rule, the throughput/latency policy)
decide.py    the policy's pure decision over measured inputs
terms.py     what it is configured by, reads and returns (PolicyConfig, PolicyInputs, Decision)
inputs.py    those inputs, measured from the live scheduler and allocator
estimators.py the meters the inputs read: flip cost per direction, token rates, output lengths, progress
"""
