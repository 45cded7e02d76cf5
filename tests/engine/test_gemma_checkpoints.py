"""Gemma 2/3 checkpoints: the fields that change the maths are read (soft-caps, query scale, Gemma 3's rope per
layer type, the default layer types), the norms read as 1 + w, and what the engine does not serve refused
by name."""
import pytest
import torch

from phaseflip.engine.checkpoint.loader import load_model_config, load_weights
from tests.engine.test_loader import _raises
from tests.models import edited_model as _edited


def test_norms_are_read_as_one_plus_w(tiny_model_dir):
    from safetensors.torch import load_file
    d = tiny_model_dir("gemma3")
    w = load_weights(d, load_model_config(d), torch.float32)
    raw = load_file(str(d / "model.safetensors"))
    for name in ("model.norm.weight", "model.layers.1.pre_feedforward_layernorm.weight",
                 "model.layers.2.self_attn.k_norm.weight"):
        torch.testing.assert_close(w[name], raw[name] + 1)
    assert torch.equal(w["model.layers.0.mlp.up_proj.weight"], raw["model.layers.0.mlp.up_proj.weight"])


def test_default_layer_types_follow_transformers(tiny_model_dir, tmp_path):
    g2 = load_model_config(_edited(tiny_model_dir("gemma2", num_layers=4), tmp_path / "g2", layer_types=None))
    assert g2.windows == (24, 0, 24, 0)   # sliding first, then alternating
    g3 = _edited(tiny_model_dir("gemma3", num_layers=7, layer_types=None), tmp_path / "g3", layer_types=None)
    assert load_model_config(g3).windows == (24, 24, 24, 24, 24, 0, 24)   # every 6th full


def test_legacy_gemma3_rope_fields(tiny_model_dir, tmp_path):
    d = _edited(tiny_model_dir("gemma3"), tmp_path, rope_parameters=None, rope_theta=1e6, rope_local_base_freq=5000.0)
    cfg = load_model_config(d)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None and cfg.gemma.local_rope_theta == 5000.0


@pytest.mark.parametrize("kind, changes, parts", [
    ("gemma2", dict(hidden_activation="gelu"), ["hidden_activation", "'gelu'", "gelu_pytorch_tanh"]),
    ("gemma3", dict(use_bidirectional_attention=True), ["use_bidirectional_attention"]),
    ("gemma3", dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     ["sliding layers", "'linear'"]),
    ("gemma2", dict(attention_bias=True), ["attention_bias"]),
    ("gemma3", dict(architectures=["Gemma3ForConditionalGeneration"]), ["Gemma3ForConditionalGeneration"]),
])
def test_what_is_not_served_is_refused_by_name(tiny_model_dir, tmp_path, kind, changes, parts):
    _raises(["config.json", *parts], load_model_config, _edited(tiny_model_dir(kind), tmp_path, **changes))
