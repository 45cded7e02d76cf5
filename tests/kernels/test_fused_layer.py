"""The fused decode layers (kernels/cpu/fused_layer.py, layer.cpp): forward's answer and KV writes against
its operator-by-operator path (one token, or one each of up to 8 sequences; float weights, and weights in
GGUF blocks, one format or a Split of two), when a step takes them, and the op's refusals (HF parity of a
whole engine on them: tests/engine/test_parity.py)."""
from __future__ import annotations

import dataclasses
import platform
import shutil
from unittest import mock

import numpy as np
import pytest
import torch

from phaseflip.kernels.cpu import fused_layer, library, linear, quant
from phaseflip.kernels.reference.rotary import cos_sin_table
from phaseflip.rank import forward, weights
from phaseflip.rank.kvcache import KVShape, KVView
from phaseflip.rank.model_config import ModelConfig
from phaseflip.rank.shard import RankShard
from phaseflip.rank.weights import LayerWeights, RankWeights, Split

H, I, HQ, HKV, D, LAYERS, BLOCK = 192, 320, 6, 2, 32, 3, 16
TABLE = [5, 2, 7, 0, 1, 3]   # the sequence's blocks, out of order
# float32: the fused layers and torch's operators sum the same products in different orders (torch's GEMM
# blocks them as its CPU build chooses), ~1e-5 apart after three layers; a wrong value is off by far more
FLOAT32 = dict(rtol=1e-5, atol=4e-5)


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    if library.decode_layers_op() is None and (platform.system() != "Linux" or shutil.which("g++") is None):
        pytest.skip(f"no CPU kernels here: {library.kernel_report()['reason']}")
    assert library.decode_layers_op() is not None, library.kernel_report()   # Linux with g++: it builds


class NoComm:
    def all_reduce(self, x):
        return x


def model(arch: str, dtype: torch.dtype, seed: int = 0, h: int = H, i: int = I, hq: int = HQ):
    cfg = ModelConfig(architecture=arch, vocab_size=100, hidden_size=h, intermediate_size=i, num_layers=LAYERS,
                      num_heads=hq, num_kv_heads=HKV, head_dim=D, rms_norm_eps=1e-6, rope_theta=10000.0,
                      max_position_embeddings=512, tie_word_embeddings=False,
                      qkv_bias=arch.startswith("Qwen2"), qk_norm=arch.startswith("Qwen3"))
    g = torch.Generator().manual_seed(seed)

    def r(*shape, base=0.0):
        return (base + torch.randn(*shape, generator=g) * 0.2).to(dtype)
    layers = [LayerWeights(
        input_layernorm=r(h, base=1), qkv_proj=r((hq + 2 * HKV) * D, h),
        qkv_bias=r((hq + 2 * HKV) * D) if cfg.qkv_bias else None,
        q_norm=r(D, base=1) if cfg.qk_norm else None, k_norm=r(D, base=1) if cfg.qk_norm else None,
        o_proj=r(h, hq * D), post_attention_layernorm=r(h, base=1), gate_up_proj=r(2 * i, h), down_proj=r(h, i))
        for _ in range(LAYERS)]
    return cfg, RankWeights(embed_tokens=r(100, h), layers=layers, norm=r(h, base=1), lm_head=r(100, h))


def one_token(ctx: int) -> dict[str, torch.Tensor]:
    """The metadata of one decode token at position ctx - 1 of a sequence in TABLE's blocks."""
    pos = ctx - 1
    slot = TABLE[pos // BLOCK] * BLOCK + pos % BLOCK
    return {"input_ids": torch.tensor([7]), "positions": torch.tensor([pos]), "slot_mapping": torch.tensor([slot]),
            "block_tables": torch.tensor([TABLE]), "seq_lens": torch.tensor([ctx]),
            "query_start_loc": torch.tensor([0, 1])}


def tokens(ctxs: list[int]) -> dict[str, torch.Tensor]:
    """The metadata of one decode token in each of len(ctxs) sequences, sequence i at position ctxs[i] - 1
    in its own blocks (out of order; 0: a padding sequence, stored nowhere, attending nothing)."""
    tables = [[(7 * (6 * i + j) + 3) % 48 for j in range(6)] for i in range(len(ctxs))]   # 48 blocks, none shared
    pos = [max(ctx - 1, 0) for ctx in ctxs]
    slots = [t[p // BLOCK] * BLOCK + p % BLOCK if ctx else -1 for t, p, ctx in zip(tables, pos, ctxs)]
    return {"input_ids": torch.arange(7, 7 + len(ctxs)), "positions": torch.tensor(pos),
            "slot_mapping": torch.tensor(slots), "block_tables": torch.tensor(tables),
            "seq_lens": torch.tensor(ctxs), "query_start_loc": torch.arange(len(ctxs) + 1)}


def run_both(arch: str, dtype: torch.dtype, ctx: int | list[int], built=None):
    """(fused, operators): forward's output and the KV cache after it, from the same filled cache, for one
    token at position ctx - 1 (a list: one token each of several sequences, `tokens`); built: (cfg,
    weights) of LAYERS layers of D-sized heads (default: model(arch, dtype))."""
    cfg, w = built or model(arch, dtype)
    several = isinstance(ctx, list)
    shape = KVShape(num_layers=LAYERS, num_blocks=48 if several else 8, block_size=BLOCK, num_kv_heads=HKV,
                    head_dim=D)
    filled = torch.randn(shape.numel, generator=torch.Generator().manual_seed(1)).to(dtype)
    rope, shard = cos_sin_table(D, 512, 10000.0), RankShard.full(cfg)
    meta = tokens(ctx) if several else one_token(ctx)
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
    torch.testing.assert_close(out, want, **FLOAT32)
    torch.testing.assert_close(kv, want_kv, **FLOAT32)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("ctxs", [[40, 1], [40, 1, 17, 90, 3], [40, 1, 17, 90, 3, 16, 0, 33]])
def test_several_sequences_give_the_operators_answer(arch, ctxs):
    """One token each of 2, 5 and 8 sequences (the last with a padding one): every row as the operators
    give it, each token's K/V in its own sequence's blocks."""
    (out, kv), (want, want_kv) = run_both(arch, torch.float32, ctxs)
    assert out.shape == (len(ctxs), H)
    torch.testing.assert_close(out, want, **FLOAT32)
    torch.testing.assert_close(kv, want_kv, **FLOAT32)


def test_several_sequences_in_bfloat16_round_as_the_operators():
    """Bit for bit up to 4 rows, where the operators' products are the few-rows kernel's row dot too (more
    rows take the wide kernel, whose sums add in another order)."""
    (out, kv), (want, want_kv) = run_both("Qwen3ForCausalLM", torch.bfloat16, [40, 1, 17, 90])
    assert torch.equal(out, want) and torch.equal(kv, want_kv)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_bfloat16_rounds_where_the_operators_round(arch):
    (out, kv), (want, want_kv) = run_both(arch, torch.bfloat16, 40)
    assert torch.equal(out, want) and torch.equal(kv, want_kv)


def in_blocks(weight: torch.Tensor, name: str, seed: int) -> torch.Tensor:
    """A weight [n, k] as GGUF blocks of format `name`, uint8 [n, blocks, block bytes] as the arena holds them:
    quantized by gguf where its quantizer writes the format, else random blocks with small finite scales."""
    gguf = pytest.importorskip("gguf", reason="the gguf package (a test dependency) is not installed")
    fmt = quant.block_format(name)
    n, k = weight.shape
    rng = np.random.default_rng(seed)
    if name in ("Q4_K", "Q6_K"):
        raw = rng.integers(0, 256, (n, k // fmt.block_values, fmt.block_bytes), dtype=np.uint8)
        for at in {"Q4_K": (0, 2), "Q6_K": (208,)}[name]:
            scales = rng.uniform(1e-4, 1e-3, (n, k // fmt.block_values)).astype(np.float16)
            raw[:, :, at:at + 2] = scales.view(np.uint8).reshape(n, -1, 2)
    else:
        raw = gguf.quants.quantize(weight.float().numpy(), gguf.GGMLQuantizationType[name])
    return torch.from_numpy(np.ascontiguousarray(raw)).view(n, k // fmt.block_values, fmt.block_bytes)


def quantized(arch: str, dtype: torch.dtype, formats: tuple[str, str]):
    """model() of 256-wide rows with every projection in GGUF blocks: q and k, gate, o in formats[0]; v, up,
    down in formats[1] (a Split where they differ, as a Q4_K_M file's layers are)."""
    cfg, w = model(arch, dtype, h=256, i=512, hq=8)
    a, b = formats

    def stack(parts):   # one weight where the formats agree, else a Split
        held = weights.stack(parts)
        return held if isinstance(held, Split) else torch.cat(held.parts)
    layers = []
    for n, lw in enumerate(w.layers):
        q_k, v = lw.qkv_proj.split([(8 + HKV) * D, HKV * D])
        gate, up = lw.gate_up_proj.chunk(2)
        layers.append(dataclasses.replace(
            lw, qkv_proj=stack((in_blocks(q_k, a, n), in_blocks(v, b, n))),
            gate_up_proj=stack((in_blocks(gate, a, n), in_blocks(up, b, n))),
            o_proj=in_blocks(lw.o_proj, a, n), down_proj=in_blocks(lw.down_proj, b, n)))
    return cfg, dataclasses.replace(w, layers=layers)


@pytest.mark.parametrize("formats", [("Q8_0", "Q8_0"), ("Q4_0", "Q4_1"), ("Q5_0", "Q5_1"), ("Q4_K", "Q6_K")])
def test_fused_layers_on_gguf_blocks_give_the_operators_answer(formats):
    built = quantized("Qwen2ForCausalLM", torch.float32, formats)
    assert isinstance(built[1].layers[0].qkv_proj, Split) == (formats[0] != formats[1])
    (out, kv), (want, want_kv) = run_both("Qwen2ForCausalLM", torch.float32, 40, built)
    # the products agree bit for bit; the norms add in another order (K formats' random blocks: larger values)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv, want_kv, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("formats", [("Q4_0", "Q8_0"), ("Q4_K", "Q6_K")])
def test_fused_layers_on_gguf_blocks_round_as_the_operators_in_bfloat16(formats):
    (out, kv), (want, want_kv) = run_both("LlamaForCausalLM", torch.bfloat16, 40,
                                          quantized("LlamaForCausalLM", torch.bfloat16, formats))
    assert torch.equal(out, want) and torch.equal(kv, want_kv)


def test_the_token_is_stored_in_every_layer_and_nothing_else():
    (_, kv), _ = run_both("LlamaForCausalLM", torch.float32, 17)
    filled = torch.randn(kv.numel(), generator=torch.Generator().manual_seed(1)).view(kv.shape)
    block, off = divmod(TABLE[16 // BLOCK] * BLOCK + 16 % BLOCK, BLOCK)
    changed = (kv != filled).any(dim=5).any(dim=4).any(dim=2)    # [blocks, layers, block_size]
    assert changed.nonzero().tolist() == [[block, layer, off] for layer in range(LAYERS)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_final_norm_is_the_last_add_and_norm(dtype):
    """With the final norm (a rank that holds the head) the call ends as forward's _add_norm does."""
    _, w = model("LlamaForCausalLM", dtype)
    residual = torch.randn(1, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    rope = cos_sin_table(D, 512, 10000.0)[torch.tensor([39])]

    def call(final_norm=None):
        kv = torch.zeros(8, LAYERS, 2, BLOCK, HKV, D, dtype=dtype)
        return fused_layer.decoder_layers(w, 1e-6, D ** -0.5, residual, one_token(40), kv, rope, final_norm)
    delta, res = call()
    normed, stream = call(w.norm)
    want, want_stream = forward._add_norm(delta, res, w.norm, 1e-6)
    assert torch.equal(stream, want_stream)
    # bf16: the sum of squares adds in another order than torch's, so a value may land one rounding apart
    tolerance = FLOAT32 if dtype == torch.float32 else dict(rtol=0, atol=0.02)
    torch.testing.assert_close(normed, want, **tolerance)


def test_which_calls_run_fused(monkeypatch):
    monkeypatch.setattr(linear, "_chosen", {})   # this test's forms; the process's come back after it
    for dtype in (torch.float32, torch.float16):
        linear.follow(dtype, small={1: "kernel", 2: "kernel", 4: "kernel"})   # what the boot measured fastest
    F32 = torch.float32
    x, kv, tables = torch.zeros(1, H), torch.zeros(1, 1, 2, BLOCK, HKV, D), torch.zeros(1, 4, dtype=torch.long)
    assert fused_layer.serves(x, F32, 1, kv, tables)
    assert not fused_layer.serves(torch.zeros(2, H), F32, 1, kv, tables)          # two tokens of one sequence
    assert not fused_layer.serves(x, F32, 1, kv, torch.zeros(2, 4, dtype=torch.long))   # two sequences
    for seqs in (2, 8, 9):   # one token each of up to MAX_ROWS sequences
        tables_of = torch.zeros(seqs, 4, dtype=torch.long)
        assert fused_layer.serves(torch.zeros(seqs, H), F32, 1, kv, tables_of) == (seqs <= 8)
    assert not fused_layer.serves(torch.zeros(2, H), torch.uint8, 1, kv, torch.zeros(2, 4, dtype=torch.long))
    assert not fused_layer.serves(x, F32, 2, kv, tables)                           # tensor-parallel partial sums
    assert not fused_layer.serves(x.half(), torch.float16, 1, kv, tables)
    assert fused_layer.serves(x, torch.uint8, 1, kv, tables)                    # weights in GGUF blocks
    assert fused_layer.report(torch.uint8, 1)["reason"] is None
    assert not fused_layer.serves(x, torch.bfloat16, 1, kv, tables)             # weights of another dtype
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

    def call(layers=w.layers, residual=torch.zeros(1, H), cache=kv, meta=meta, cos_sin=cos_sin, final_norm=None):
        return fused_layer.decoder_layers(dataclasses.replace(w, layers=layers), 1e-6, D ** -0.5, residual, meta,
                                          cache, cos_sin, final_norm)
    call()
    with pytest.raises(RuntimeError, match=r"final_norm must be a contiguous CPU vector of 192 Float, got \[96\]"):
        call(final_norm=w.norm[:96])
    with pytest.raises(RuntimeError, match=r"one token a sequence for the residual's 2, got 1 tokens and 1 seq"):
        call(residual=torch.zeros(2, H))
    with pytest.raises(RuntimeError, match=r"residual \[M, H\], 1 <= M <= 8, got \[9, 192\]"):
        call(residual=torch.zeros(9, H))
    two = tokens([5, 9])
    with pytest.raises(RuntimeError, match="weights in GGUF blocks take one token, got 2"):
        last = w.layers[-1]
        call(layers=[*w.layers[:-1], dataclasses.replace(last, down_proj=in_blocks(last.down_proj, "Q8_0", 0))],
             residual=torch.zeros(2, H), meta=two, cos_sin=torch.zeros(2, D),
             cache=torch.zeros(48, LAYERS, 2, BLOCK, HKV, D))
    with pytest.raises(RuntimeError, match="float32 or bfloat16, got Half"):
        call(residual=torch.zeros(1, H, dtype=torch.half))
    with pytest.raises(RuntimeError, match="down_proj must be a CPU \\[192, 320\\] weight"):
        broken = [LayerWeights(**{**lw.tensors(), "qkv_bias": None, "q_norm": None, "k_norm": None,
                                  "down_proj": lw.down_proj[:, :100]}) for lw in w.layers]
        call(layers=broken)
    with pytest.raises(RuntimeError, match=r"o_proj must be a CPU \[192, 192\] weight with contiguous rows \(or its "
                       r"GGUF blocks\), got \[192, 5, 34\]"):   # Q8_0 blocks of 160 values a row
        last = w.layers[-1]   # the first layer's o_proj gives the heads: a later one is checked against them
        call(layers=[*w.layers[:-1], dataclasses.replace(last, o_proj=in_blocks(last.o_proj[:, :160], "Q8_0", 0))])
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
