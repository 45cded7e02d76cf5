"""Mixture-of-experts checkpoints: the config fields as transformers reads them, the expert tensors under
one naming (Mixtral's block_sparse_moe / w1 w3 w2 and the Qwen MoEs' mlp.experts), each rank's share of
every expert, and bad MoE fields refused by name."""
import pytest
import torch

from phaseflip.engine.checkpoint.loader import CheckpointError, load_model_config, load_weights
from phaseflip.rank.planner import plan_layouts
from phaseflip.rank.shard import Span
from phaseflip.rank.weights import shard_weights
from tests.engine.test_loader import _raises
from tests.models import edited_model as _edited


def test_mixtral_names_become_the_engines(tiny_model_dir):
    d = tiny_model_dir("mixtral")
    cfg = load_model_config(d)
    w = load_weights(d, cfg, torch.float32)
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in w and "model.layers.2.mlp.gate.weight" in w
    assert not any("block_sparse_moe" in n or ".w1." in n for n in w)
    from safetensors.torch import load_file
    raw = load_file(str(d / "model.safetensors"))
    assert torch.equal(w["model.layers.1.mlp.experts.2.up_proj.weight"],
                       raw["model.layers.1.block_sparse_moe.experts.2.w3.weight"])
    assert torch.equal(w["model.layers.1.mlp.experts.2.down_proj.weight"],
                       raw["model.layers.1.block_sparse_moe.experts.2.w2.weight"])


def test_qwen3_moe_dense_layers_hold_a_dense_mlp(tiny_model_dir):
    d = tiny_model_dir("qwen3moe")
    cfg = load_model_config(d)
    assert [cfg.is_sparse(i) for i in range(3)] == [True, False, True]
    w = load_weights(d, cfg, torch.float32)
    assert w["model.layers.1.mlp.gate_proj.weight"].shape == (128, 64)
    assert "model.layers.1.mlp.gate.weight" not in w and "model.layers.0.mlp.gate.weight" in w


def test_each_tp_rank_holds_its_share_of_every_expert(tiny_model_dir):
    d = tiny_model_dir("qwen2moe", hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    cfg = load_model_config(d)
    hf = load_weights(d, cfg, torch.float32)
    plan = plan_layouts(cfg, [1.0, 1.0, 1.0])
    spans = [s.expert_mlp for s in plan.tp.shards]
    assert spans == [Span(0, 11), Span(11, 11), Span(22, 10)]
    assert [s.shared_mlp for s in plan.tp.shards] == [Span(0, 16), Span(16, 16), Span(32, 16)]
    for shard in plan.tp.shards:
        lw = shard_weights(hf, cfg, shard).layers[0]
        e = shard.expert_mlp
        assert lw.experts_gate_up.shape == (8 * 2 * e.count, 96) and lw.experts_down.shape == (8 * 96, e.count)
        gate_up = torch.empty(lw.experts_gate_up.shape)
        lw.experts_gate_up.copy_into(gate_up)
        expert5 = gate_up.view(8, 2 * e.count, 96)[5]
        assert torch.equal(expert5[:e.count], hf["model.layers.0.mlp.experts.5.gate_proj.weight"][e.start:e.stop])
        assert torch.equal(expert5[e.count:], hf["model.layers.0.mlp.experts.5.up_proj.weight"][e.start:e.stop])
        assert torch.equal(lw.router, hf["model.layers.0.mlp.gate.weight"])   # whole on every rank
    for shard in plan.pp.shards:
        assert shard.expert_mlp == Span(0, 32) and shard.shared_mlp == Span(0, 48)


@pytest.mark.parametrize("kind, changes, parts", [
    ("qwen3moe", dict(num_experts_per_tok=7), ["num_experts_per_tok", "7", "6 experts"]),
    ("qwen3moe", dict(mlp_only_layers="1"), ["mlp_only_layers"]),
    ("qwen3moe", dict(moe_intermediate_size=0), ["moe_intermediate_size"]),
    ("qwen2moe", dict(shared_expert_intermediate_size=None), ["shared_expert_intermediate_size"]),
    ("mixtral", dict(num_local_experts=0), ["num_local_experts"]),
])
def test_bad_moe_fields_are_refused_by_name(tiny_model_dir, tmp_path, kind, changes, parts):
    _raises(["config.json", *parts], load_model_config, _edited(tiny_model_dir(kind), tmp_path, **changes))


def test_moe_families_not_served_are_refused_by_name(tiny_model_dir, tmp_path):
    for arch in ("DeepseekV3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "OlmoeForCausalLM"):
        d = _edited(tiny_model_dir("qwen3moe"), tmp_path / arch, architectures=[arch])
        with pytest.raises(CheckpointError, match=arch):
            load_model_config(d)
