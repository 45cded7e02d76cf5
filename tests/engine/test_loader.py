"""engine/checkpoint/loader.py: config parsing, weight loading and validation, dtype choice, tokenizer parity with HF."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from phaseflip.engine.checkpoint.loader import (CheckpointError, expected_tensor_shapes, load_model_config, load_weights,
                                     resolve_dtype)
from phaseflip.engine.checkpoint.tokenizer import load_tokenizer
from phaseflip.engine.checkpoint.gemma_config import plus_one
from phaseflip.engine.checkpoint.moe_config import engine_names
from phaseflip.rank.model_config import GemmaStyle, LinearRope, MoeConfig, RopeScaling, YarnRope
from tests.models import KINDS, TOKENIZER_VOCAB_SIZE, compare_greedy, hf_greedy, make_tokenizer

SMOLLM2_DIR = Path.home() / ".cache" / "phaseflip" / "SmolLM2-135M-Instruct"
LLAMA3_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
TEXTS = ["Hello, world!", "The quick brown fox", "  leading and trailing spaces  ", "", "naïve café 東京 🙂",
         "<|im_start|>user\nhi<|im_end|>", "What is 2 + 2?\n\tIt is 4.", "<|endoftext|>tail",
         "Hello , world . Isn 't it ?"]


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "model"))


def _edit_config(model_dir: Path, **changes) -> Path:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))
    return model_dir


def _raises(match_all: list[str], fn, *args):
    with pytest.raises(CheckpointError) as info:
        fn(*args)
    for part in match_all:
        assert part in str(info.value), f"{part!r} not in {info.value}"
    return info.value


# ---------------------------------------------------------------------------------------------- config

GEMMA = {"gemma2": GemmaStyle(query_pre_attn_scalar=24.0, attn_softcap=2.0, final_softcap=5.0),
         "gemma3": GemmaStyle(query_pre_attn_scalar=24.0, local_rope_theta=10000.0)}
MOE = {"mixtral": MoeConfig(num_experts=4, top_k=2, expert_intermediate_size=48, norm_topk_prob=True),
       "qwen2moe": MoeConfig(num_experts=8, top_k=2, expert_intermediate_size=32, norm_topk_prob=False,
                             shared_intermediate_size=48),
       "qwen3moe": MoeConfig(num_experts=6, top_k=2, expert_intermediate_size=32, norm_topk_prob=True,
                             dense_layers=(1,))}


@pytest.mark.parametrize("kind", KINDS)
def test_config_parses_each_architecture(tiny_model_dir, kind):
    model_dir = tiny_model_dir(kind)
    hf = json.loads((model_dir / "config.json").read_text())
    config = load_model_config(model_dir)
    assert config.architecture == hf["architectures"][0]
    assert (config.vocab_size, config.hidden_size) == (TOKENIZER_VOCAB_SIZE, 64)
    assert config.intermediate_size == (48 if kind == "mixtral" else 128)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.group_size) == (3, 4, 2, 2)
    assert config.head_dim == (32 if kind == "qwen3" else 16)
    assert config.qkv_bias == (kind in ("qwen2", "yarnrope", "qwen2moe", "qwen2window"))
    assert config.windows == {"mistralwindow": (24, 24, 24), "qwen2window": (0, 20, 20), "gemma2": (24, 0, 24),
                              "gemma3": (24, 0, 24)}.get(kind, ())
    assert config.gemma == GEMMA.get(kind)
    assert config.qk_norm == (kind in ("qwen3", "qwen3moe", "gemma3"))
    assert config.moe == MOE.get(kind)
    assert config.tie_word_embeddings is False
    assert config.rms_norm_eps == hf["rms_norm_eps"]
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)
    assert config.torch_dtype == "float32"
    if kind == "llama3rope":
        assert config.rope_theta == 500000.0 and config.max_position_embeddings == 512
        assert config.rope_scaling == RopeScaling(**LLAMA3_ROPE)
    elif kind == "linearrope":
        assert config.rope_scaling == LinearRope(factor=4.0)
    elif kind == "phi3longrope":   # served within its original context, on the short factors
        assert config.max_position_embeddings == 128 and config.rope_scaling.factors[1] == 1.1
        assert config.rope_scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(8) / math.log(128)))
    elif kind == "gemma3":   # the full layers' rope; the sliding layers' base in config.gemma
        assert config.rope_theta == 100000.0 and config.rope_scaling == LinearRope(factor=2.0)
    elif kind == "yarnrope":   # attention_factor from transformers' default mscale: 0.1 ln(4) + 1
        assert config.rope_scaling == YarnRope(factor=4.0, original_max_position_embeddings=64,
                                               attention_factor=pytest.approx(1.1386294))
    else:
        assert config.rope_theta == 10000.0 and config.max_position_embeddings == 256
        assert config.rope_scaling is None


def test_legacy_rope_fields_parse_like_rope_parameters(tiny_model_dir, tmp_path):
    expected = load_model_config(tiny_model_dir("llama3rope"))
    for key in ("type", "rope_type"):
        model_dir = _copy(tiny_model_dir("llama3rope"), tmp_path / key)
        _edit_config(model_dir, rope_parameters=None, rope_theta=500000.0,
                     rope_scaling={key: "llama3", **LLAMA3_ROPE})
        assert load_model_config(model_dir) == expected
    model_dir = _edit_config(_copy(tiny_model_dir("llama"), tmp_path / "plain"), rope_parameters=None,
                             rope_theta=1234.0, rope_scaling=None)
    config = load_model_config(model_dir)
    assert config.rope_theta == 1234.0 and config.rope_scaling is None


def test_legacy_linear_and_yarn_fields_parse(tiny_model_dir, tmp_path):
    """rope_scaling (transformers 4) as rope_parameters: yarn's factor defaults to max_position_embeddings
    over the original context, and mscale / mscale_all_dim set its attention factor as transformers does."""
    model_dir = _edit_config(_copy(tiny_model_dir("llama"), tmp_path / "linear"), rope_parameters=None,
                             rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert load_model_config(model_dir).rope_scaling == LinearRope(factor=2.0)
    yarn = {"rope_type": "yarn", "original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 1.0,
            "beta_fast": 16}
    model_dir = _edit_config(_copy(tiny_model_dir("llama"), tmp_path / "yarn"), rope_parameters=None,
                             rope_theta=10000.0, rope_scaling=yarn)
    got = load_model_config(model_dir).rope_scaling
    want = (0.1 * 0.707 * math.log(4.0) + 1) / (0.1 * math.log(4.0) + 1)   # factor 256 / 64
    assert got == YarnRope(factor=4.0, original_max_position_embeddings=64, attention_factor=pytest.approx(want),
                           beta_fast=16.0)


def test_config_defaults_follow_hf(tiny_model_dir, tmp_path):
    llama = _edit_config(_copy(tiny_model_dir("llama"), tmp_path / "llama"), head_dim=None, num_key_value_heads=None,
                         rope_parameters=None, eos_token_id=[2, 0], tie_word_embeddings=None)
    config = load_model_config(llama)
    assert (config.head_dim, config.num_kv_heads, config.rope_theta) == (16, 4, 10000.0)
    assert config.eos_token_ids == (2, 0) and config.tie_word_embeddings is False
    qwen3 = _edit_config(_copy(tiny_model_dir("qwen3"), tmp_path / "qwen3"), head_dim=None)
    assert load_model_config(qwen3).head_dim == 128   # Qwen3Config's default, not hidden // heads


def test_sliding_windows_per_layer_as_transformers_sets_them(tiny_model_dir, tmp_path):
    mistral = _copy(tiny_model_dir("mistral"), tmp_path / "mistral")
    assert load_model_config(mistral).windows == ()
    windowed = load_model_config(_edit_config(mistral, sliding_window=128))
    assert windowed.windows == (128, 128, 128) and windowed.max_position_embeddings == 256   # full context
    assert load_model_config(_edit_config(mistral, sliding_window=4096)).windows == ()   # never outgrown
    qwen2 = _copy(tiny_model_dir("qwen2"), tmp_path / "qwen2")
    assert load_model_config(_edit_config(qwen2, sliding_window=16, max_window_layers=1)).windows == ()
    assert load_model_config(_edit_config(qwen2, sliding_window=16, max_window_layers=1,
                                          use_sliding_window=True, layer_types=None)).windows == (0, 16, 16)
    typed = _edit_config(qwen2, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert load_model_config(typed).windows == (16, 0, 16)
    _raises(["config.json", "'layer_types'"], load_model_config, _edit_config(qwen2, layer_types=["local"] * 3))


@pytest.mark.parametrize("changes, parts", [
    (dict(rope_parameters={"rope_type": "su", "factor": 4.0}), ["rope_parameters", "'su'", "'linear', 'yarn'"]),
    (dict(rope_parameters={"rope_type": "dynamic"}), ["'factor'"]),
    (dict(rope_parameters=None, rope_scaling={"type": "longrope", "factor": 2.0}),
     ["longrope", "original_max_position_embeddings"]),
    (dict(rope_parameters={"rope_type": "longrope", "original_max_position_embeddings": 64, "short_factor": [1.0],
                           "long_factor": [1.0] * 8}), ["short_factor", "8 positive numbers"]),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), ["original_max_position_embeddings"]),
    (dict(rope_parameters={"rope_type": "linear"}), ["'factor'"]),
    (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.75}), ["partial_rotary_factor"]),
    (dict(partial_rotary_factor=0.5), ["partial_rotary_factor"]),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}), ["low_freq_factor"]),
    (dict(rope_parameters={"full_attention": {"rope_type": "default"}}), ["rope_parameters", "per-layer"]),
    (dict(attention_bias=True), ["attention_bias"]),
    (dict(hidden_act="gelu"), ["hidden_act"]),
    (dict(hidden_size=None), ["'hidden_size'"]),
    (dict(num_hidden_layers="3"), ["'num_hidden_layers'", "must be a number"]),
    (dict(num_attention_heads=0), ["num_attention_heads"]),
    (dict(architectures=["GPT2LMHeadModel"]), ["GPT2LMHeadModel", "architectures"]),
    (dict(architectures=None), ["'architectures'"]),
    (dict(num_key_value_heads=3), ["num_key_value_heads"]),   # ModelConfig's own check, re-raised
])
def test_bad_config_names_file_and_field(tiny_model_dir, tmp_path, changes, parts):
    model_dir = _edit_config(_copy(tiny_model_dir("llama"), tmp_path), **changes)
    _raises(["config.json", *parts], load_model_config, model_dir)


@pytest.mark.parametrize("field, spec, method", [
    ("quantization_config", {"quant_method": "gptq", "bits": 4, "group_size": 128}, "'gptq'"),
    ("quantization_config", {"quant_method": "awq", "bits": 4, "version": "gemm"}, "'awq'"),
    ("quantization_config", {"quant_method": "fp8", "activation_scheme": "dynamic"}, "'fp8'"),
    ("quantization_config", {"quant_method": "compressed-tensors", "format": "float-quantized"},
     "'compressed-tensors'"),
    ("quantization_config", {"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ("compression_config", {"format": "pack-quantized"}, "'pack-quantized'"),
    ("quantization_config", "int8", "'unnamed'"),
])
def test_quantized_checkpoint_is_refused_with_its_method(tiny_model_dir, tmp_path, field, spec, method):
    model_dir = _edit_config(_copy(tiny_model_dir("llama"), tmp_path), **{field: spec})
    _raises(["config.json", field, method, "not served"], load_model_config, model_dir)


def test_quantized_checkpoint_is_refused_before_any_weight_is_read(tiny_model_dir, tmp_path):
    """LLM() reads config.json before it starts a rank or opens a safetensors file: a corrupt weights file
    behind an FP8 config still yields the quantization error."""
    from phaseflip import LLM
    model_dir = _edit_config(_copy(tiny_model_dir("llama"), tmp_path),
                             quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    for f in model_dir.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="'fp8'"):
        LLM(model=str(model_dir), device="cpu")


def test_missing_or_invalid_config_json(tiny_model_dir, tmp_path):
    model_dir = _copy(tiny_model_dir("llama"), tmp_path)
    (model_dir / "config.json").write_text("{not json")
    _raises([str(model_dir / "config.json"), "invalid JSON"], load_model_config, model_dir)
    (model_dir / "config.json").unlink()
    _raises([str(model_dir / "config.json"), "not found"], load_model_config, model_dir)
    _raises([str(tmp_path / "nowhere"), "no such file or directory", "a .gguf file"], load_model_config,
            tmp_path / "nowhere")
    (tmp_path / "prompts.jsonl").write_text("{}\n")
    _raises([str(tmp_path / "prompts.jsonl"), "a file that is not GGUF"], load_model_config,
            tmp_path / "prompts.jsonl")


# ---------------------------------------------------------------------------------------------- weights

@pytest.mark.parametrize("kind", KINDS)
def test_weights_load_and_match_the_files(tiny_model_dir, kind):
    model_dir = tiny_model_dir(kind)
    config = load_model_config(model_dir)
    weights = load_weights(model_dir, config, torch.float32)
    expected = expected_tensor_shapes(config)   # the file's names: Phi-3 stores qkv_proj and gate_up_proj
    on_disk = plus_one(engine_names(load_file(str(model_dir / "model.safetensors")), config), config)   # Mixtral's
    # w1/w3/w2 under the engine's names; Gemma's norms read as 1 + w
    expected = engine_names(expected, config)
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    seen = set()
    for name, shape in expected.items():
        joined = next((k for k in fused if f".{k}." in name), None)
        parts = [name.replace(joined, p) for p in fused[joined]] if joined else [name]
        got = torch.cat([weights[p] for p in parts])
        assert got.dtype == torch.float32 and tuple(got.shape) == shape
        assert torch.equal(got, on_disk[name]), name
        seen.update(parts)
    assert seen == set(weights)
    assert kind.startswith("phi3") == any("qkv_proj" in name for name in expected)


def test_expected_shapes_cover_biases_norms_and_head_dim(tiny_model_dir):
    qwen3 = expected_tensor_shapes(load_model_config(tiny_model_dir("qwen3")))
    assert qwen3["model.layers.0.self_attn.q_proj.weight"] == (128, 64)      # 4 heads x head_dim 32
    assert qwen3["model.layers.0.self_attn.k_proj.weight"] == (64, 64)       # 2 kv heads x 32
    assert qwen3["model.layers.2.self_attn.o_proj.weight"] == (64, 128)
    assert qwen3["model.layers.1.self_attn.q_norm.weight"] == (32,)
    assert "model.layers.0.self_attn.q_proj.bias" not in qwen3
    qwen2 = expected_tensor_shapes(load_model_config(tiny_model_dir("qwen2")))
    assert qwen2["model.layers.0.self_attn.q_proj.bias"] == (64,)
    assert qwen2["model.layers.0.self_attn.v_proj.bias"] == (32,)
    assert len(qwen2) == 3 + 3 * 12 and len(qwen3) == 3 + 3 * 11


def test_randomised_fixtures_are_not_degenerate(tiny_model_dir):
    weights = load_weights(tiny_model_dir("qwen2"), load_model_config(tiny_model_dir("qwen2")), torch.float32)
    assert not torch.all(weights["model.norm.weight"] == 1)
    assert weights["model.layers.0.self_attn.k_proj.bias"].abs().min() > 0
    q3 = load_weights(tiny_model_dir("qwen3"), load_model_config(tiny_model_dir("qwen3")), torch.float32)
    assert not torch.all(q3["model.layers.0.self_attn.q_norm.weight"] == 1)


def test_sharded_checkpoint_loads_identically(tiny_model_dir):
    sharded = tiny_model_dir("qwen2", sharded=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    config = load_model_config(sharded)
    a = load_weights(sharded, config, torch.float32)
    b = load_weights(tiny_model_dir("qwen2"), config, torch.float32)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_index_names_exactly_the_files_read(tiny_model_dir, tmp_path):
    model_dir = _copy(tiny_model_dir("llama", sharded=True), tmp_path)
    save_file({"model.norm.weight": torch.zeros(7)}, str(model_dir / "stray.safetensors"))  # not in the index
    config = load_model_config(model_dir)
    assert load_weights(model_dir, config, torch.float32)["model.norm.weight"].shape == (64,)


def test_tied_embeddings(tiny_model_dir, tmp_path):
    tied = tiny_model_dir("llama", tie=True)
    config = load_model_config(tied)
    assert config.tie_word_embeddings
    weights = load_weights(tied, config, torch.float32)
    assert "lm_head.weight" not in weights and "lm_head.weight" not in expected_tensor_shapes(config)
    # A tied checkpoint that still carries lm_head (and a rotary buffer): both ignored.
    model_dir = _copy(tied, tmp_path)
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["lm_head.weight"] = torch.zeros(3, 3)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, str(model_dir / "model.safetensors"))
    assert load_weights(model_dir, config, torch.float32).keys() == weights.keys()


def test_weights_cast_to_dtype(tiny_model_dir):
    config = load_model_config(tiny_model_dir("llama"))
    weights = load_weights(tiny_model_dir("llama"), config, torch.bfloat16)
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}


def test_missing_tensor(tiny_model_dir, tmp_path):
    model_dir = _copy(tiny_model_dir("qwen2"), tmp_path)
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(model_dir / "model.safetensors"))
    _raises([str(model_dir), "'model.layers.1.self_attn.k_proj.bias'", "missing", "model.safetensors"],
            load_weights, model_dir, load_model_config(model_dir), torch.float32)


def test_wrong_shape(tiny_model_dir, tmp_path):
    model_dir = _copy(tiny_model_dir("llama"), tmp_path)
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.2.mlp.down_proj.weight"] = torch.zeros(64, 100)
    save_file(tensors, str(path))
    _raises([str(path), "'model.layers.2.mlp.down_proj.weight'", "(64, 100)", "expected (64, 128)"],
            load_weights, model_dir, load_model_config(model_dir), torch.float32)


def test_truncated_safetensors(tiny_model_dir, tmp_path):
    model_dir = _copy(tiny_model_dir("llama"), tmp_path)
    path = model_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _raises([str(path), "truncated or corrupt"], load_weights, model_dir, load_model_config(model_dir), torch.float32)


def test_corrupt_header(tiny_model_dir, tmp_path):
    model_dir = _copy(tiny_model_dir("llama", sharded=True), tmp_path)
    path = sorted(model_dir.glob("*.safetensors"))[1]
    path.write_bytes(b"\x13\x37garbage" * 100)
    _raises([str(path), "truncated or corrupt"], load_weights, model_dir, load_model_config(model_dir), torch.float32)


def test_index_naming_a_missing_file(tiny_model_dir, tmp_path):
    model_dir = _copy(tiny_model_dir("llama", sharded=True), tmp_path)
    victim = sorted(model_dir.glob("*.safetensors"))[0]
    victim.unlink()
    _raises(["model.safetensors.index.json", victim.name], load_weights, model_dir,
            load_model_config(model_dir), torch.float32)


def test_no_safetensors_at_all(tiny_model_dir, tmp_path):
    model_dir = _copy(tiny_model_dir("llama"), tmp_path)
    (model_dir / "model.safetensors").unlink()
    _raises([str(model_dir), "no *.safetensors"], load_weights, model_dir, load_model_config(model_dir),
            torch.float32)


# ---------------------------------------------------------------------------------------------- dtype

@pytest.mark.parametrize("name, dtype", [("float32", torch.float32), ("fp32", torch.float32),
                                         ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
                                         ("float16", torch.float16), ("fp16", torch.float16),
                                         ("half", torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_resolve_dtype_names(name, dtype):
    assert resolve_dtype(name, "cpu") == dtype


def test_resolve_dtype_auto():
    assert resolve_dtype("auto", "cpu", "bfloat16") == torch.float32
    assert resolve_dtype("auto", "cuda:1", "float16") == torch.float16
    assert resolve_dtype("auto", "cuda", "bfloat16") == torch.bfloat16
    assert resolve_dtype("auto", "cuda", "float32") == torch.bfloat16
    assert resolve_dtype("auto", "cuda") == torch.bfloat16


@pytest.mark.parametrize("bad", ["float64", "int8", "", torch.float64])
def test_resolve_dtype_rejects_bad_values(bad):
    with pytest.raises(ValueError) as info:
        resolve_dtype(bad, "cpu")
    assert str(bad) in str(info.value) and "bfloat16" in str(info.value) and "auto" in str(info.value)


# ---------------------------------------------------------------------------------------------- tokenizer

def _assert_tokenizer_matches_hf(model_dir: Path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    ours = load_tokenizer(model_dir)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"], text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    assert (ours.eos_token_id, ours.bos_token_id) == (hf.eos_token_id, hf.bos_token_id)
    assert ours.vocab_size == len(hf)
    assert set(hf.all_special_ids) <= set(ours.all_special_ids)
    chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "2+2?"}]
    for add in (True, False):
        for messages in (chat, [{"role": "system", "content": "Be brief."}] + chat):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert ours.apply_chat_template(messages, add_generation_prompt=add) == expected


@pytest.mark.parametrize("add_bos_token", [None, True, False])
def test_tokenizer_matches_hf(tmp_path, add_bos_token):
    # transformers 5 ignores add_bos_token when tokenizer.json exists: its post-processor decides.
    model_dir = make_tokenizer(tmp_path, add_bos_token=add_bos_token)
    _assert_tokenizer_matches_hf(model_dir)
    assert load_tokenizer(model_dir).encode("hi")[0] != 1


def test_clean_up_tokenization_spaces_is_skipped_for_bpe_like_hf(tmp_path):
    model_dir = make_tokenizer(tmp_path)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**cfg, "clean_up_tokenization_spaces": True}))
    _assert_tokenizer_matches_hf(model_dir)


def test_tokenizer_post_processor_adds_bos_like_hf(tmp_path):
    from tokenizers import Tokenizer, processors
    model_dir = make_tokenizer(tmp_path, add_bos_token=False)
    backend = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    backend.post_processor = processors.Sequence([      # Llama-3 style: byte-level, then prepend BOS
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|im_start|> $A", pair="<|im_start|> $A <|im_start|> $B",
                                      special_tokens=[("<|im_start|>", 1)])])
    backend.save(str(model_dir / "tokenizer.json"))
    _assert_tokenizer_matches_hf(model_dir)
    assert load_tokenizer(model_dir).encode("hi")[0] == 1


@pytest.mark.skipif(not (SMOLLM2_DIR / "tokenizer.json").is_file(), reason=f"{SMOLLM2_DIR} not present")
def test_tokenizer_matches_hf_on_smollm2():
    _assert_tokenizer_matches_hf(SMOLLM2_DIR)


def test_tokenizer_basics(tiny_tokenizer_dir):
    tok = load_tokenizer(tiny_tokenizer_dir)
    assert tok.vocab_size == TOKENIZER_VOCAB_SIZE
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1
    assert tok.all_special_ids == [0, 1, 2]
    ids = tok.encode("<|im_start|>Hello<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and tok.decode(ids) == "Hello"


def test_chat_template_jinja_file_wins(tmp_path):
    model_dir = make_tokenizer(tmp_path)
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
                                                   "{{ eos_token }}")
    assert load_tokenizer(model_dir).apply_chat_template([{"role": "user", "content": "x"}]) == "[x]<|im_end|>"


def test_chat_template_helpers(tmp_path):
    model_dir = make_tokenizer(tmp_path)
    (model_dir / "chat_template.jinja").write_text(
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
        "{{ strftime_now('%Y') }} {{ messages[0] | tojson }}")
    tok = load_tokenizer(model_dir)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]).split(" ", 1)[1] == \
        '{"role": "user", "content": "é"}'
    with pytest.raises(Exception, match="one message only"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_no_chat_template_is_a_clear_error(tmp_path):
    model_dir = make_tokenizer(tmp_path)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(model_dir)
    assert tok.encode("hi")
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_json(tmp_path):
    model_dir = make_tokenizer(tmp_path)
    (model_dir / "tokenizer.json").unlink()
    _raises([str(model_dir / "tokenizer.json"), "not found"], load_tokenizer, model_dir)


# ---------------------------------------------------------------------------------------------- fixtures

def test_compare_greedy_forgives_only_ties():
    ref = [([5, 6, 7], [0.5, 5e-5, 0.3]), ([1, 2], [0.2, 0.2])]
    assert compare_greedy([[5, 6, 7], [1, 2]], ref) == (True, 0, "match (0 tie divergences)")
    ok, ties, _ = compare_greedy([[5, 6, 9], [1, 2]], ref)            # diverges where the gap is 0.3
    assert not ok
    ok, ties, _ = compare_greedy([[5, 8, 1], [1, 2]], ref)            # diverges at a tie (5e-5 < 1e-4)
    assert ok and ties == 1
    ok, _, message = compare_greedy([[5, 6, 7], [1]], ref)             # stopped early: a real mismatch
    assert not ok and "seq 1" in message and "position 1" in message


def test_hf_greedy_reference_has_margins(tiny_model_dir):
    (ids, gaps), = hf_greedy(tiny_model_dir("qwen3"), [[5, 17, 42, 100]], max_new_tokens=6)
    assert len(ids) == len(gaps) == 6 and all(0 <= i < TOKENIZER_VOCAB_SIZE for i in ids)
    assert min(gaps) > 1e-4     # the fixtures are scaled so that greedy choices are not near-ties
    assert hf_greedy(tiny_model_dir("qwen3"), [[5, 17, 42, 100]], 6, stop_token_ids=ids[2:3])[0][0] == ids[:3]


@pytest.mark.parametrize("params", [
    {"rope_type": "linear", "factor": 2.5},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 0.707,
     "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 2.56, "original_max_position_embeddings": 100, "attention_factor": 1.3,
     "truncate": False},
    {"rope_type": "llama3", **LLAMA3_ROPE},
    {"rope_type": "dynamic", "factor": 4.0},
    {"rope_type": "longrope", "original_max_position_embeddings": 64, "short_factor": [1.0, 1.5, 2.0, 2.5] * 2,
     "long_factor": [4.0] * 8},
    {"rope_type": "longrope", "original_max_position_embeddings": 64, "short_factor": [1.2] * 8,
     "long_factor": [4.0] * 8, "attention_factor": 1.05},
])
def test_rope_frequencies_are_transformers_own(params):
    """Each scaling's frequencies and attention factor against transformers' own rope functions."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from phaseflip.engine.checkpoint.rope_config import parse_rope
    from phaseflip.kernels.reference.rotary import inv_frequencies
    raw = {"rope_parameters": {"rope_theta": 50000.0, **params}, "max_position_embeddings": 256, "hidden_size": 64,
           "num_attention_heads": 4, "head_dim": 16}
    hf = LlamaConfig(**raw)
    want, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu")
    theta, scaling = parse_rope(raw, Path("config.json"))
    torch.testing.assert_close(inv_frequencies(16, theta, scaling), want, rtol=1e-6, atol=0)
    assert getattr(scaling, "attention_factor", 1.0) == pytest.approx(factor)
