"""ModelConfig: the architecture facts the model maths needs, parsed once from config.json.

Owns: the frozen, validated description of a Llama/Mistral/Qwen2/Qwen3/Phi-3 decoder. It never reads files
(engine/checkpoint/loader.py does) and never holds weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM")


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
    """Each rotary frequency divided by its own factor: how llama.cpp's GGUF files carry llama3 scaling
    (the rope_freqs tensor its converter computes from the llama3 parameters)."""
    factors: tuple[float, ...]
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

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads
