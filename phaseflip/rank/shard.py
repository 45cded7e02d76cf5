"""What one rank holds in one layout: its layer range, head shares, MLP share and vocab share.

Owns: RankShard (with an MoE's expert and shared-expert shares), the explicit description the model maths
(forward.py) and the weight slicing (weights.py) take, so the maths never asks the process group how it is
split.
"""
from __future__ import annotations

from dataclasses import dataclass

from phaseflip.rank.model_config import ModelConfig


@dataclass(frozen=True)
class Span:
    """A half-open range [start, start + count)."""
    start: int
    count: int

    def __post_init__(self):
        if self.start < 0 or self.count < 0:
            raise ValueError(f"invalid span start={self.start} count={self.count}: both must be >= 0")

    @property
    def stop(self) -> int:
        return self.start + self.count


@dataclass(frozen=True)
class RankShard:
    layers: Span        # layers this rank runs
    kv_heads: Span      # KV heads this rank holds (its query heads are their GQA groups)
    mlp: Span           # columns of the MLP intermediate this rank holds
    vocab: Span         # rows of the embedding / lm_head this rank holds
    has_embed: bool     # runs the token embedding (first PP stage; every TP rank)
    has_head: bool      # runs the final norm and lm_head (last PP stage; every TP rank)
    tp_size: int = 1    # ranks sharing each layer (partial sums are all-reduced across them)
    expert_mlp: Span = Span(0, 0)   # columns of each expert's intermediate this rank holds (MoE)
    shared_mlp: Span = Span(0, 0)   # columns of the shared expert's intermediate (Qwen2-MoE)

    @staticmethod
    def full(cfg: ModelConfig) -> "RankShard":
        """The whole model on one rank."""
        return RankShard(layers=Span(0, cfg.num_layers), kv_heads=Span(0, cfg.num_kv_heads),
                         mlp=Span(0, cfg.intermediate_size), vocab=Span(0, cfg.vocab_size),
                         has_embed=True, has_head=True, **whole_experts(cfg))

    def q_heads(self, cfg: ModelConfig) -> Span:
        g = cfg.group_size
        return Span(self.kv_heads.start * g, self.kv_heads.count * g)


def whole_experts(cfg: ModelConfig) -> dict[str, Span]:
    """RankShard's expert and shared-expert spans of a rank that holds them whole (none: a dense model)."""
    m = cfg.moe
    if m is None:
        return {}
    return dict(expert_mlp=Span(0, m.expert_intermediate_size), shared_mlp=Span(0, m.shared_intermediate_size))
