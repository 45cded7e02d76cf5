"""ModelConfig: the architecture facts the model maths needs, parsed once from config.json.

Owns: the frozen, validated description of a Llama/Mistral/Qwen2/Qwen3/Phi-3 decoder, of the
mixture-of-experts ones (Mixtral, Qwen2-MoE, Qwen3-MoE: `MoeConfig`) and of Gemma 2/3 (`GemmaStyle`). It
never reads files (engine/checkpoint/loader.py does) and never holds weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
                 "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM",
                 "Gemma3ForCausalLM")
MOE_ARCHITECTURES = ARCHITECTURES[5:8]
GEMMA_ARCHITECTURES = ARCHITECTURES[8:]


@dataclass(frozen=True)
class GemmaStyle:
    """Where a Gemma 2/3 layer departs from a Llama one: the embedding times sqrt(hidden); RMSNorm weights
    applied as (1 + w) (the loader adds the 1); a norm on each block's output before it joins the residual
    stream; GeGLU (tanh-approximated GELU); attention scaled by query_pre_attn_scalar^-0.5; tanh
    soft-capping of the attention scores and of the final logits (Gemma 2); the sliding layers' own rope
    base (Gemma 3's rope_local_base_freq)."""
    query_pre_attn_scalar: float
    attn_softcap: float = 0.0        # 0: none
    final_softcap: float = 0.0       # 0: none
    local_rope_theta: float | None = None   # None: the sliding layers take the model's rope


@dataclass(frozen=True)
class MoeConfig:
    """The mixture-of-experts MLP: a router picks top_k of num_experts SwiGLU experts per token (softmax
    over all experts in float32, then top-k; their weights renormalised to sum to 1 where norm_topk_prob);
    Qwen2-MoE adds a shared expert every token takes, scaled by sigmoid(shared_expert_gate . x).
    dense_layers: layers whose MLP is the dense one of intermediate_size (Qwen's mlp_only_layers and
    decoder_sparse_step)."""
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int = 0   # 0: no shared expert
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("num_experts", "top_k", "expert_intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"config field {name}={getattr(self, name)} must be >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} exceeds the {self.num_experts} experts")
        if self.shared_intermediate_size < 0:
            raise ValueError(f"shared_expert_intermediate_size={self.shared_intermediate_size} must be >= 0")


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling (rope_type == "llama3"); None on ModelConfig means plain RoPE."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: ClassVar[str] = "llama3"


@dataclass(frozen=True)
class LinearRope:
    """Linear (position interpolation) scaling: every frequency divided by `factor`."""
    factor: float
    rope_type: ClassVar[str] = "linear"


@dataclass(frozen=True)
class FrequencyFactors:
    """Each rotary frequency divided by its own factor, cos and sin times attention_factor: how llama.cpp's
    GGUF files carry llama3 scaling (the rope_freqs tensor its converter computes from the llama3
    parameters), and LongRoPE within its original context (the short factors)."""
    factors: tuple[float, ...]
    attention_factor: float = 1.0
    rope_type: ClassVar[str] = "factors"


@dataclass(frozen=True)
class YarnRope:
    """YaRN scaling, as transformers computes it: frequencies blended between interpolated (/ factor) and
    kept across the dimensions whose rotations over the original context fall between beta_slow and
    beta_fast, and cos/sin multiplied by attention_factor."""
    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    rope_type: ClassVar[str] = "yarn"


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False           # Qwen2
    qk_norm: bool = False            # Qwen3
    rope_scaling: RopeScaling | LinearRope | YarnRope | FrequencyFactors | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None   # the checkpoint's declared dtype, informational
    moe: MoeConfig | None = None     # None: every layer's MLP is dense
    windows: tuple[int, ...] = ()    # each layer's sliding window (0: full attention); (): none anywhere
    gemma: GemmaStyle | None = None  # Gemma 2/3's departures; None: a Llama-style layer

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"config field {name}={getattr(self, name)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if (self.gemma is not None) != (self.architecture in GEMMA_ARCHITECTURES):
            raise ValueError(f"{self.architecture} {'needs' if self.gemma is None else 'takes no'} Gemma fields "
                             "(gemma)")
        if (self.moe is not None) != (self.architecture in MOE_ARCHITECTURES):
            raise ValueError(f"{self.architecture} {'needs' if self.moe is None else 'takes no'} mixture-of-experts "
                             "fields (moe)")
        if self.windows and (len(self.windows) != self.num_layers or min(self.windows) < 0):
            raise ValueError(f"windows={list(self.windows)}: one window >= 0 per layer ({self.num_layers})")
        if self.moe is not None and not all(0 <= i < self.num_layers for i in self.moe.dense_layers):
            raise ValueError(f"mlp_only_layers={list(self.moe.dense_layers)} names a layer outside "
                             f"0..{self.num_layers - 1}")

    @property
    def attention_scale(self) -> float:
        """What the attention scores are scaled by: head_dim^-0.5, Gemma's query_pre_attn_scalar^-0.5."""
        return (self.gemma.query_pre_attn_scalar if self.gemma else self.head_dim) ** -0.5

    def window(self, layer: int) -> int:
        """Layer's sliding window: a query at position p attends keys p - window < j <= p (0: every j <= p)."""
        return self.windows[layer] if self.windows else 0

    @property
    def least_window(self) -> int:
        """The sliding window every layer has at least (0: some layer attends every earlier position)."""
        return min(self.windows) if self.windows else 0

    def is_sparse(self, layer: int) -> bool:
        """Whether this layer's MLP is the mixture of experts."""
        return self.moe is not None and layer not in self.moe.dense_layers

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads
