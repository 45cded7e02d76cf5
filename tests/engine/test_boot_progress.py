"""The boot's progress bar counts exactly the phases its ranks report, in their order, each named as it
starts."""
from phaseflip import LLM
from phaseflip.engine.ranks import group as group_module
from phaseflip.engine.ranks.progress import BootProgress, rank_phases


def test_the_bar_expects_the_phases_a_rank_reports(tiny_model_dir, monkeypatch):
    seen = {}

    class Recording(BootProgress):
        def __init__(self, boot, world_size):
            super().__init__(boot, world_size)
            seen["expected"], seen["reported"], seen["started"] = rank_phases(boot), [], []

        def update(self, msg):
            seen["reported" if msg.ms is not None else "started"].append(msg.phase)

    monkeypatch.setattr(group_module, "BootProgress", Recording)
    with LLM(model=str(tiny_model_dir("llama")), dtype="float32", compile="off", max_num_seqs=2,
             max_num_batched_tokens=64, decode_buckets=(1, 2), prefill_buckets=(64,)):
        pass
    assert seen["reported"] == seen["expected"] and "gemm_warm:pp" in seen["expected"]
    assert seen["started"] == seen["expected"]
