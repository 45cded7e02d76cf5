"""The transformer maths for one rank's shard, over paged KV, for a batch mixing prefill and decode.

Owns: the forward pass of a Llama/Mistral/Qwen2/Qwen3 decoder (and of the mixture-of-experts ones:
`moe_block`, and Gemma 2/3's departures: cfg.gemma) written once (`forward`, over a
`StepState`: what one rank holds in one layout). What the rank holds comes
from RankShard (layer range, heads, MLP share, vocab share); partial sums are reduced with explicit
`comm.all_reduce` calls at their call sites. Never asks a process group how it is split.

Shapes: T tokens in the flattened batch, H hidden, D head_dim, hq / hkv this rank's query / KV heads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from phaseflip.kernels.attention import attend
from phaseflip.kernels.cpu import fused_layer
from phaseflip.kernels.dispatch import (add_rms_norm, apply_rotary, embedding, gelu_tanh_and_mul, linear, moe_experts,
                                       rms_norm, route, silu_and_mul)
from phaseflip.rank.kvcache import KVView
from phaseflip.rank.model_config import ModelConfig
from phaseflip.rank.weights import LayerWeights, RankWeights, Split
from phaseflip.rank.shard import RankShard


class Comm(Protocol):
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...


def embed(w: RankWeights, cfg: ModelConfig, shard: RankShard, input_ids: torch.Tensor, comm: Comm) -> torch.Tensor:
    # input_ids: [T] -> [T, H]; Gemma's times sqrt(H) as its dtype holds it
    v = shard.vocab
    if shard.tp_size == 1:
        x = embedding(input_ids, w.embed_tokens, w.dtype)
    else:
        local = input_ids - v.start
        outside = (local < 0) | (local >= v.count)
        x = comm.all_reduce(embedding(local.clamp(0, v.count - 1), w.embed_tokens, w.dtype) * ~outside[:, None])
    return x * float(torch.tensor(cfg.hidden_size ** 0.5, dtype=x.dtype)) if cfg.gemma else x


def project(x: torch.Tensor, w: torch.Tensor | Split, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T (+ bias) for a fused projection: one product, or a Split's parts' side by side."""
    if not isinstance(w, Split):
        return linear(x, w, bias)
    y = torch.cat([linear(x, p) for p in w.parts], dim=-1)
    return y if bias is None else y + bias


def attention_block(lw: LayerWeights, cfg: ModelConfig, shard: RankShard, h: torch.Tensor,
                    meta: dict[str, torch.Tensor], kv: KVView, layer: int,
                    cos_sin: torch.Tensor, comm: Comm) -> torch.Tensor:
    d, hq, hkv = cfg.head_dim, shard.q_heads(cfg).count, shard.kv_heads.count
    qkv = project(h, lw.qkv_proj, lw.qkv_bias)                  # [T, (hq + 2 hkv) * D]
    qk, v = qkv.split([(hq + hkv) * d, hkv * d], dim=-1)
    v = v.reshape(-1, hkv, d)
    if cfg.qk_norm:
        q, k = qk.view(-1, hq + hkv, d).split([hq, hkv], dim=1)
        q, k = rms_norm(q, lw.q_norm, cfg.rms_norm_eps), rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
        q, k = apply_rotary(q, cos_sin), apply_rotary(k, cos_sin)
    else:  # one rotary over the q and k heads together: half the small ops per layer
        q, k = apply_rotary(qk.view(-1, hq + hkv, d), cos_sin).split([hq, hkv], dim=1)
    softcap = cfg.gemma.attn_softcap if cfg.gemma else 0.0
    o = attend(q.contiguous(), k.contiguous(), v.contiguous(), kv.tensor, layer, meta, cfg.attention_scale,
               lw.window, softcap)                                                    # [T, hq, D]
    return comm.all_reduce(linear(o.view(-1, hq * d), lw.o_proj))  # [T, H]


def mlp_block(lw: LayerWeights, h: torch.Tensor, comm: Comm, act=silu_and_mul) -> torch.Tensor:
    return comm.all_reduce(_mlp(lw, h, act))


def _mlp(lw: LayerWeights, h: torch.Tensor, act=silu_and_mul) -> torch.Tensor:
    """The gated MLP of gate_up_proj and down_proj: this rank's partial sum."""
    return linear(act(project(h, lw.gate_up_proj)), lw.down_proj)


def moe_block(lw: LayerWeights, cfg: ModelConfig, h: torch.Tensor, comm: Comm) -> torch.Tensor:
    """A mixture-of-experts MLP: every rank routes every token (the router is whole on each), multiplies
    its share of each chosen expert's FFN, adds its share of the shared expert (scaled by its gate), and
    the partial sums are reduced once."""
    m = cfg.moe
    weights, ids = route(linear(h, lw.router), m.top_k, m.norm_topk_prob)        # [T, k] each
    out = moe_experts(h, *lw.expert_weights(), ids, weights)                     # [T, H]
    if lw.gate_up_proj is not None:   # the shared expert: a dense MLP every token takes
        out = out + torch.sigmoid(linear(h, lw.shared_gate)) * _mlp(lw, h)
    return comm.all_reduce(out)


def decoder_layer(lw: LayerWeights, cfg: ModelConfig, shard: RankShard, delta: torch.Tensor | None,
                  residual: torch.Tensor, meta: dict[str, torch.Tensor], kv: KVView, layer: int,
                  cos_sin: torch.Tensor, comm: Comm) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer: (the previous block's output, the residual stream) in, the same out. The
    unit a compiled step compiles once and reuses for every layer of the model."""
    eps = cfg.rms_norm_eps
    h, residual = _add_norm(delta, residual, lw.input_layernorm, eps)
    delta = attention_block(lw, cfg, shard, h, meta, kv, layer, cos_sin, comm)
    if lw.attn_out_norm is not None:   # Gemma: each block's output normed before it joins the stream
        delta = rms_norm(delta, lw.attn_out_norm, eps)
    h, residual = add_rms_norm(delta, residual, lw.post_attention_layernorm, eps)
    if lw.router is not None:
        return moe_block(lw, cfg, h, comm), residual
    if cfg.gemma is None:
        return mlp_block(lw, h, comm), residual
    return rms_norm(mlp_block(lw, h, comm, gelu_tanh_and_mul), lw.mlp_out_norm, eps), residual


@dataclass(frozen=True)
class StepState:
    """What one rank's step in one layout reads besides the step's own tensors: its weights, model, shard,
    KV view, rope table and the group its partial sums are reduced over. A saved compiled step takes it as
    its owner (graphs/saved_steps.py)."""
    weights: RankWeights
    cfg: ModelConfig
    shard: RankShard
    kv: KVView
    rope_table: torch.Tensor
    comm: Comm
    local_rope_table: torch.Tensor | None = None   # the sliding layers' own (Gemma 3); None: rope_table


def forward(state: StepState, meta: dict[str, torch.Tensor], layer_fn=decoder_layer) -> torch.Tensor:
    """Run this rank's layers over one step's tensors: what a layout's buckets record and replay. meta:
    input_ids [T], positions [T] and the attention metadata of kernels/attention.py; on a later PP stage
    hidden_in [T, H], which it takes instead of embedding input_ids. Returns [T, H]: final-normed on the
    stage that holds the head, the raw residual stream otherwise. layer_fn: decoder_layer itself, or a
    compiled version of it. The fused decode layers stand in for decoder_layer only: a step that compiled
    its layer (a compiled prefill, whose views pad the sequences, so that its tokens may number its
    sequences without being one each) runs that."""
    w, cfg, shard, kv, comm = state.weights, state.cfg, state.shard, state.kv, state.comm
    residual = embed(w, cfg, shard, meta["input_ids"], comm) if shard.has_embed else meta["hidden_in"]  # [T, H]
    cos_sin = state.rope_table[meta["positions"]]                    # [T, D]
    local = cos_sin if state.local_rope_table is None else state.local_rope_table[meta["positions"]]
    delta = None  # the last block's output, not yet added to the residual stream (fused add + norm)
    if layer_fn is decoder_layer and w.layers and fused_layer.serves(residual, w.layers[0].qkv_proj.dtype, shard.tp_size, kv.tensor,
                                       meta["block_tables"], w.plain):
        # one token a sequence, every layer (and the final norm where the head is here), one call
        out, residual = fused_layer.decoder_layers(w, cfg.rms_norm_eps, cfg.head_dim ** -0.5, residual, meta,
                                                   kv.tensor, cos_sin, w.norm if shard.has_head else None)
        if shard.has_head:
            return out
        delta = out
    else:
        for i, lw in enumerate(w.layers):
            delta, residual = layer_fn(lw, cfg, shard, delta, residual, meta, kv, i, local if lw.window else cos_sin,
                                       comm)
    if shard.has_head:
        return _add_norm(delta, residual, w.norm, cfg.rms_norm_eps)[0]
    return residual if delta is None else residual + delta


def _add_norm(delta, residual, weight, eps):
    """(rms_norm(residual + delta), residual + delta); delta None: nothing to add yet."""
    if delta is None:
        return rms_norm(residual, weight, eps), residual
    return add_rms_norm(delta, residual, weight, eps)


def compute_logits(lm_head: torch.Tensor, hidden: torch.Tensor, softcap: float = 0.0) -> torch.Tensor:
    # hidden: [N, H] (final-normed rows to sample), lm_head: [V_rank, H] -> [N, V_rank] in float32;
    # softcap > 0: softcap * tanh(logits / softcap) (Gemma 2's final soft-capping)
    logits = linear(hidden, lm_head).float()
    return softcap * torch.tanh(logits / softcap) if softcap else logits


def final_softcap(cfg: ModelConfig) -> float:
    """The cap compute_logits applies for this model (0: none)."""
    return cfg.gemma.final_softcap if cfg.gemma else 0.0
