"""The fused one-token decoder layers (kernels/cpu/fused_layer.py, layer.cpp): forward's answer and KV
writes against its operator-by-operator path, when a step takes them, and the op's refusals (HF parity
of a whole engine on them: tests/engine/test_parity.py)."""
from __future__ import annotations

import platform
import shutil
from unittest import mock

import pytest
import torch

from phaseflip.kernels.cpu import fused_layer, library, linear
from phaseflip.kernels.reference.rotary import cos_sin_table
from phaseflip.rank import forward
from phaseflip.rank.kvcache import KVShape, KVView
from phaseflip.rank.model_config import ModelConfig
from phaseflip.rank.weights import LayerWeights, RankWeights
from phaseflip.rank.shard import RankShard

H, I, HQ, HKV, D, LAYERS, BLOCK = 192, 320, 6, 2, 32, 3, 16
TABLE = [5, 2, 7, 0, 1, 3]   # the sequence's blocks, out of order


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    if library.decode_layers_op() is None and (platform.system() != "Linux" or shutil.which("g++") is None):
        pytest.skip(f"no CPU kernels here: {library.kernel_report()['reason']}")
    assert library.decode_layers_op() is not None, library.kernel_report()   # Linux with g++: it builds


class NoComm:
    def all_reduce(self, x):
        return x


def model(arch: str, dtype: torch.dtype, seed: int = 0):
    cfg = ModelConfig(architecture=arch, vocab_size=100, hidden_size=H, intermediate_size=I, num_layers=LAYERS,
                      num_heads=HQ, num_kv_heads=HKV, head_dim=D, rms_norm_eps=1e-6, rope_theta=10000.0,
                      max_position_embeddings=512, tie_word_embeddings=False,
                      qkv_bias=arch.startswith("Qwen2"), qk_norm=arch.startswith("Qwen3"))
    g = torch.Generator().manual_seed(seed)

    def r(*shape, base=0.0):
        return (base + torch.randn(*shape, generator=g) * 0.2).to(dtype)
    layers = [LayerWeights(
        input_layernorm=r(H, base=1), qkv_proj=r((HQ + 2 * HKV) * D, H),
        qkv_bias=r((HQ + 2 * HKV) * D) if cfg.qkv_bias else None,
        q_norm=r(D, base=1) if cfg.qk_norm else None, k_norm=r(D, base=1) if cfg.qk_norm else None,
        o_proj=r(H, HQ * D), post_attention_layernorm=r(H, base=1), gate_up_proj=r(2 * I, H), down_proj=r(H, I))
        for _ in range(LAYERS)]
    return cfg, RankWeights(embed_tokens=r(100, H), layers=layers, norm=r(H, base=1), lm_head=r(100, H))


def one_token(ctx: int) -> dict[str, torch.Tensor]:
    """The metadata of one decode token at position ctx - 1 of a sequence in TABLE's blocks."""
    pos = ctx - 1
    slot = TABLE[pos // BLOCK] * BLOCK + pos % BLOCK
    return {"input_ids": torch.tensor([7]), "positions": torch.tensor([pos]), "slot_mapping": torch.tensor([slot]),
            "block_tables": torch.tensor([TABLE]), "seq_lens": torch.tensor([ctx]),
            "query_start_loc": torch.tensor([0, 1])}


def run_both(arch: str, dtype: torch.dtype, ctx: int):
    """(fused, operators): forward's output and the KV cache after it, from the same filled cache."""
    cfg, w = model(arch, dtype)
    shape = KVShape(num_layers=LAYERS, num_blocks=8, block_size=BLOCK, num_kv_heads=HKV, head_dim=D)
    filled = torch.randn(shape.numel, generator=torch.Generator().manual_seed(1)).to(dtype)
    rope, meta, shard = cos_sin_table(D, 512, 10000.0), one_token(ctx), RankShard.full(cfg)
    results = []
    for fused in (True, False):
        kv = KVView(filled.clone(), shape)
        with mock.patch.object(fused_layer, "serves", lambda *a, fused=fused: fused):
            results.append((forward.forward(forward.StepState(w, cfg, shard, kv, rope, NoComm()), meta), kv.tensor))
    return results


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("ctx", [1, 17, 90])   # the first position, one past a block, six blocks
def test_fused_layers_give_the_operators_answer(arch, ctx):
    (out, kv), (want, want_kv) = run_both(arch, torch.float32, ctx)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv, want_kv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_bfloat16_rounds_where_the_operators_round(arch):
    (out, kv), (want, want_kv) = run_both(arch, torch.bfloat16, 40)
    assert torch.equal(out, want) and torch.equal(kv, want_kv)


def test_the_token_is_stored_in_every_layer_and_nothing_else():
    (_, kv), _ = run_both("LlamaForCausalLM", torch.float32, 17)
    filled = torch.randn(kv.numel(), generator=torch.Generator().manual_seed(1)).view(kv.shape)
    block, off = divmod(TABLE[16 // BLOCK] * BLOCK + 16 % BLOCK, BLOCK)
    changed = (kv != filled).any(dim=5).any(dim=4).any(dim=2)    # [blocks, layers, block_size]
    assert changed.nonzero().tolist() == [[block, layer, off] for layer in range(LAYERS)]


def test_which_calls_run_fused(monkeypatch):
    monkeypatch.setattr(linear, "_chosen", {})   # this test's forms; the process's come back after it
    for dtype in (torch.float32, torch.float16):
        linear.follow(dtype, small={1: "kernel", 2: "kernel", 4: "kernel"})   # what the boot measured fastest
    F32 = torch.float32
    x, kv, tables = torch.zeros(1, H), torch.zeros(1, 1, 2, BLOCK, HKV, D), torch.zeros(1, 4, dtype=torch.long)
    assert fused_layer.serves(x, F32, 1, kv, tables)
    assert not fused_layer.serves(torch.zeros(2, H), F32, 1, kv, tables)          # two tokens
    assert not fused_layer.serves(x, F32, 1, kv, torch.zeros(2, 4, dtype=torch.long))   # two sequences
    assert not fused_layer.serves(x, F32, 2, kv, tables)                           # tensor-parallel partial sums
    assert not fused_layer.serves(x.half(), torch.float16, 1, kv, tables)
    assert not fused_layer.serves(x, torch.uint8, 1, kv, tables)                # weights in GGUF blocks
    assert "GGUF block format" in fused_layer.report(torch.uint8, 1)["reason"]
    with monkeypatch.context() as traced:
        traced.setattr(torch.compiler, "is_compiling", lambda: True)         # a traced step: inductor's
        assert not fused_layer.serves(x, F32, 1, kv, tables)
    linear.follow(torch.float32, small={1: "library", 2: "library", 4: "library"})
    assert not fused_layer.serves(x, F32, 1, kv, tables)                           # the boot measured another faster
    report = fused_layer.report(torch.float32, 1)
    assert report["choice"] == "operators" and "'library'" in report["reason"]
    monkeypatch.setattr(linear, "_chosen", {})
    assert not fused_layer.serves(x, F32, 1, kv, tables)                           # nothing measured
    assert fused_layer.report(torch.float32, 2)["reason"].startswith("layers split over 2 ranks")


def test_the_op_names_what_it_refuses():
    cfg, w = model("LlamaForCausalLM", torch.float32)
    kv = torch.zeros(8, LAYERS, 2, BLOCK, HKV, D)
    meta = one_token(5)
    cos_sin = torch.zeros(1, D)

    def call(layers=w.layers, residual=torch.zeros(1, H), cache=kv, meta=meta, cos_sin=cos_sin):
        return fused_layer.decoder_layers(layers, 1e-6, D ** -0.5, residual, meta, cache, cos_sin)
    call()
    with pytest.raises(RuntimeError, match=r"one token's contiguous CPU residual \[1, H\], got \[2, 192\]"):
        call(residual=torch.zeros(2, H))
    with pytest.raises(RuntimeError, match="float32 or bfloat16, got Half"):
        call(residual=torch.zeros(1, H, dtype=torch.half))
    with pytest.raises(RuntimeError, match="down_proj must be a CPU \\[192, 320\\] weight"):
        broken = [LayerWeights(**{**lw.tensors(), "qkv_bias": None, "q_norm": None, "k_norm": None,
                                  "down_proj": lw.down_proj[:, :100]}) for lw in w.layers]
        call(layers=broken)
    with pytest.raises(RuntimeError, match="a layer each of 3"):
        call(cache=kv[:, :2])
    with pytest.raises(RuntimeError, match="slot 99999 is past the cache's 8 blocks of 16"):
        call(meta={**meta, "slot_mapping": torch.tensor([99999])})
    with pytest.raises(RuntimeError, match="block id 9 outside 0..7"):
        call(meta={**meta, "block_tables": torch.tensor([[9, 0, 1, 2, 3, 4]])})
    with pytest.raises(RuntimeError, match=r"cos_sin \[1, D\] float32"):
        call(cos_sin=torch.zeros(1, D + 2))
    with pytest.raises(RuntimeError, match="an even head size and kv heads, got D 31"):
        call(cache=torch.zeros(8, LAYERS, 2, BLOCK, HKV, D - 1))
