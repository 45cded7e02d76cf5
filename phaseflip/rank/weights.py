"""Which slice of each checkpoint tensor a rank holds, fused the way forward.py reads it.

Owns: RankWeights / LayerWeights and `shard_weights`, which describes this rank's fused tensors
(qkv_proj = [q; k; v] rows of its heads, gate_up_proj = [gate; up] rows of its MLP share; an MoE layer's
router whole and each expert's [gate; up] and down shares stacked expert after expert) as views of
the HF-named checkpoint tensors and `Stacked` row blocks: nothing is copied here; packing (arena.py)
copies each source once, straight into its place. A weight in a GGUF block format is shared on whole
blocks; a fused projection whose parts the file stores in different formats stays a `Split`. Module
names follow the checkpoint so loading is a mapping, not a search.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch

from phaseflip.kernels.cpu import quant
from phaseflip.rank.model_config import ModelConfig
from phaseflip.rank.shard import RankShard


@dataclass(frozen=True)
class Stacked:
    """Row blocks to be stacked along dim 0 into one tensor, never materialised on their own: packing
    copies each block into its rows of the destination (no torch.cat temporary)."""
    parts: tuple[torch.Tensor, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(p.shape[0] for p in self.parts), *self.parts[0].shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    def copy_into(self, out: torch.Tensor) -> None:
        row = 0
        for p in self.parts:
            out[row:row + p.shape[0]].copy_(p)
            row += p.shape[0]


@dataclass(frozen=True)
class Split:
    """A fused projection whose row blocks a GGUF file stores in different formats (a Q4_K_M keeps q and
    k in one and v in another): each part stays a weight of its own (an arena slot `<name>.<j>`),
    multiplied on its own, the outputs side by side (forward.project)."""
    parts: tuple[torch.Tensor, ...]

    def __post_init__(self):
        if _one_storage(self.parts):
            raise ValueError("parts of one storage stack into one weight (Stacked), not a Split")

    @property
    def dtype(self) -> torch.dtype:
        """uint8 (a part is in a block format): what the float-only paths test a weight for."""
        return torch.uint8


def stack(parts: tuple[torch.Tensor, ...]) -> Stacked | Split:
    """Row blocks of one fused projection: one weight where they share a storage, else a Split."""
    return Stacked(parts) if _one_storage(parts) else Split(parts)


def _one_storage(parts: tuple[torch.Tensor, ...]) -> bool:
    """Whether the parts' rows are alike (dtype, and shape past the rows: a block format's block bytes)."""
    return len({(p.dtype, tuple(p.shape[1:])) for p in parts}) == 1


@dataclass
class LayerWeights:
    input_layernorm: torch.Tensor            # [H]
    qkv_proj: torch.Tensor                   # [(hq + 2 hkv) * D, H]
    qkv_bias: torch.Tensor | None            # [(hq + 2 hkv) * D]
    q_norm: torch.Tensor | None              # [D]
    k_norm: torch.Tensor | None              # [D]
    o_proj: torch.Tensor                     # [H, hq * D]
    post_attention_layernorm: torch.Tensor   # [H]
    gate_up_proj: torch.Tensor | None        # [2 * I, H]: the dense MLP, or an MoE's shared expert (None: none)
    down_proj: torch.Tensor | None           # [H, I]
    router: torch.Tensor | None = None       # [E, H]: an MoE layer's router (every rank holds it whole)
    experts_gate_up: torch.Tensor | None = None   # [E * 2 * Ie, H]: expert e's [gate; up] rows at e * 2 * Ie
    experts_down: torch.Tensor | None = None      # [E * H, Ie]: expert e's down_proj at rows e * H
    shared_gate: torch.Tensor | None = None       # [1, H]: the shared expert's sigmoid gate (Qwen2-MoE)
    attn_out_norm: torch.Tensor | None = None   # [H]: Gemma's attention-output norm (post_attention_layernorm)
    mlp_out_norm: torch.Tensor | None = None    # [H]: Gemma's MLP-output norm (post_feedforward_layernorm)
    window: int = 0                          # the layer's sliding window (0: full attention)

    @functools.cached_property
    def signature(self) -> tuple:
        """Each weight's name, shape and dtype, and the window: what a compiled layer is specialised on (the
        layers of a GGUF file may store their projections in different formats; a model may alternate
        sliding and full attention)."""
        return (self.window, *((name, tuple(t.shape), t.dtype) for name, t in self.tensors().items()))

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """An MoE layer's experts as the grouped products read them: [gate; up] [E, 2 Ie, H] and down
        [E, H, Ie] (E and H from the router's [E, H])."""
        experts, hidden = self.router.shape
        return self.experts_gate_up.view(experts, -1, hidden), self.experts_down.view(experts, hidden, -1)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Each weight by name; a Split's parts as `<name>.<j>`."""
        out = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if isinstance(t, Split):
                out.update({f"{f.name}.{j}": p for j, p in enumerate(t.parts)})
            elif t is not None and f.name != "window":
                out[f.name] = t
        return out


@dataclass
class RankWeights:
    embed_tokens: torch.Tensor | None        # [V_rank, H]
    layers: list[LayerWeights]
    norm: torch.Tensor | None                # [H]
    lm_head: torch.Tensor | None             # [V_rank, H]

    @functools.cached_property
    def plain(self) -> bool:
        """Whether every layer here is a Llama-style one with a dense MLP and full attention (what the fused
        decode layers run)."""
        return all(lw.router is None and not lw.window and lw.attn_out_norm is None for lw in self.layers)

    @functools.cached_property
    def across_layers(self) -> dict[str, tuple[list[torch.Tensor], list[int]]]:
        """Each LayerWeights field's tensors over the layers in layer order (a Split's parts in place), with
        how many each layer holds (0 where absent): what one call over every layer reads
        (kernels/cpu/fused_layer.py), gathered once."""
        out = {}
        for f in fields(LayerWeights):
            held = [getattr(getattr(lw, f.name), "parts", (getattr(lw, f.name),)) for lw in self.layers]
            held = [tuple(t for t in p if isinstance(t, torch.Tensor)) for p in held]
            out[f.name] = ([t for p in held for t in p], [len(p) for p in held])
        return out

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: its norms' (every rank holds a layer or the final norm; a projection or the
        embedding may be in a GGUF block format)."""
        return self.layers[0].input_layernorm.dtype if self.layers else self.norm.dtype

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {n: t for n, t in (("embed_tokens", self.embed_tokens), ("norm", self.norm),
                                 ("lm_head", self.lm_head)) if t is not None}
        for i, layer in enumerate(self.layers):
            out.update({f"layers.{i}.{n}": t for n, t in layer.tensors().items()})
        return out


def replace_tensors(w: RankWeights, new: dict[str, torch.Tensor]) -> RankWeights:
    """The same structure with every tensor replaced by new[name] (names as in RankWeights.tensors())."""
    def layer(i: int, lw: LayerWeights) -> LayerWeights:
        def one(name: str, old):
            if isinstance(old, Split):
                return Split(tuple(new[f"layers.{i}.{name}.{j}"] for j in range(len(old.parts))))
            return old if name == "window" else new.get(f"layers.{i}.{name}")
        return LayerWeights(**{f.name: one(f.name, getattr(lw, f.name)) for f in fields(LayerWeights)})
    return RankWeights(embed_tokens=new.get("embed_tokens"), norm=new.get("norm"), lm_head=new.get("lm_head"),
                       layers=[layer(i, lw) for i, lw in enumerate(w.layers)])


def _rows(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return t[start:start + count]


def _cols(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Columns [start, start + count) of a weight; of one in a GGUF block format (uint8 [rows, blocks,
    block bytes]), the blocks that hold them, which a split must not cut."""
    fmt = quant.weight_format(t)
    if fmt is None:
        return t[:, start:start + count]
    if start % fmt.block_values or count % fmt.block_values:
        raise ValueError(f"a {fmt.name} weight's columns [{start}, {start + count}) are not whole "
                         f"{fmt.block_values}-value blocks: this split cannot share it")
    return t[:, start // fmt.block_values:(start + count) // fmt.block_values]


def _layer(hf: dict, cfg: ModelConfig, shard: RankShard, i: int) -> LayerWeights:
    p = f"model.layers.{i}."
    d = cfg.head_dim
    q, kv, mlp = shard.q_heads(cfg), shard.kv_heads, shard.mlp
    q_rows = (q.start * d, q.count * d)
    kv_rows = (kv.start * d, kv.count * d)

    def qkv(kind: str) -> Stacked:
        return stack((_rows(hf[f"{p}self_attn.q_proj.{kind}"], *q_rows),
                      _rows(hf[f"{p}self_attn.k_proj.{kind}"], *kv_rows),
                      _rows(hf[f"{p}self_attn.v_proj.{kind}"], *kv_rows)))

    dense = None if cfg.is_sparse(i) else p + "mlp."
    mlp_weights = _mlp(hf, dense, mlp) if dense else _moe(hf, cfg, shard, p + "mlp.")
    return LayerWeights(
        input_layernorm=hf[p + "input_layernorm.weight"],
        qkv_proj=qkv("weight"),
        qkv_bias=qkv("bias") if cfg.qkv_bias else None,
        q_norm=hf[p + "self_attn.q_norm.weight"] if cfg.qk_norm else None,
        k_norm=hf[p + "self_attn.k_norm.weight"] if cfg.qk_norm else None,
        o_proj=_cols(hf[p + "self_attn.o_proj.weight"], *q_rows),
        **_norms(hf, cfg, p),
        **mlp_weights,
        window=cfg.window(i),
    )


def _norms(hf: dict, cfg: ModelConfig, p: str) -> dict:
    """The norm before the MLP, and Gemma's norms of the two blocks' outputs (its pre_feedforward_layernorm
    is the one before the MLP; its post_attention_layernorm normalises the attention's output)."""
    if cfg.gemma is None:
        return dict(post_attention_layernorm=hf[p + "post_attention_layernorm.weight"])
    return dict(post_attention_layernorm=hf[p + "pre_feedforward_layernorm.weight"],
                attn_out_norm=hf[p + "post_attention_layernorm.weight"],
                mlp_out_norm=hf[p + "post_feedforward_layernorm.weight"])


def _mlp(hf: dict, p: str, share) -> dict:
    """A SwiGLU MLP's fused weights (names under prefix p), its intermediate columns `share`."""
    return dict(gate_up_proj=stack((_rows(hf[p + "gate_proj.weight"], share.start, share.count),
                                    _rows(hf[p + "up_proj.weight"], share.start, share.count))),
                down_proj=_cols(hf[p + "down_proj.weight"], share.start, share.count))


def _moe(hf: dict, cfg: ModelConfig, shard: RankShard, p: str) -> dict:
    """An MoE layer's weights: the router whole, every expert's share of its FFN (like the dense MLP's),
    stacked expert after expert; the shared expert where the family has one."""
    e, experts = shard.expert_mlp, range(cfg.moe.num_experts)
    out = dict(router=hf[p + "gate.weight"],
               experts_gate_up=Stacked(tuple(_rows(hf[f"{p}experts.{j}.{name}_proj.weight"], e.start, e.count)
                                             for j in experts for name in ("gate", "up"))),
               experts_down=Stacked(tuple(_cols(hf[f"{p}experts.{j}.down_proj.weight"], e.start, e.count)
                                          for j in experts)),
               gate_up_proj=None, down_proj=None)
    if cfg.moe.shared_intermediate_size:
        out.update(_mlp(hf, p + "shared_expert.", shard.shared_mlp), shared_gate=hf[p + "shared_expert_gate.weight"])
    return out


def shard_weights(hf: dict[str, torch.Tensor], cfg: ModelConfig, shard: RankShard) -> RankWeights:
    """This rank's fused weights from HF-named checkpoint tensors (already validated by the loader), as
    views and Stacked blocks of them (a column share stays a strided view)."""
    embed = hf["model.embed_tokens.weight"]
    head = embed if cfg.tie_word_embeddings else hf["lm_head.weight"]
    v = shard.vocab
    return RankWeights(
        embed_tokens=_rows(embed, v.start, v.count) if shard.has_embed else None,
        layers=[_layer(hf, cfg, shard, i) for i in range(shard.layers.start, shard.layers.stop)],
        norm=hf["model.norm.weight"] if shard.has_head else None,
        lm_head=_rows(head, v.start, v.count) if shard.has_head else None,
    )
