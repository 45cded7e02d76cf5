"""The GPU check's run description: the model shapes, the two profiles (FULL on one GPU, DRY on the CPU with
tiny shapes) and the Context every section receives (profile, scratch folder, deadline, what earlier
sections produced). Plain data: no torch import, no device work.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=500000.0,
                rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192))
SMOLLM2_30 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                  rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000.0)
LLAMA_8B = dict(LLAMA_1B, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                rope_scaling=dict(LLAMA_1B["rope_scaling"], factor=8.0))
TINY = dict(LLAMA_1B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=384, max_position_embeddings=512,
            rope_scaling=dict(LLAMA_1B["rope_scaling"], original_max_position_embeddings=64))
TINY_30 = dict(TINY, num_hidden_layers=3, tie_word_embeddings=True)     # the dry run's "SmolLM2-30" and
TINY_BIG = dict(TINY, num_hidden_layers=3, tie_word_embeddings=False)  # "8B" stand-ins
DRY_KERNEL_CASES = ("attention/decode-g3-d64-page16-splits3", "attention/prefill-g4-d64-page32-splits2",
                    "attention/op-mixed-bf16", "kv_store/page16", "add_rms_norm/bfloat16-rows7-h100",
                    "rotary/llama3-float32-d64", "silu_and_mul/bfloat16-5x100", "quant/Q4_K-bf16-20-rows")


@dataclass(frozen=True)
class Profile:
    device: str
    model: dict
    max_model_len: int
    decode_buckets: tuple[int, ...]
    prefill_buckets: tuple[int, ...]
    prompt_len: int
    num_prompts: int
    gen_tokens: int
    bench_batches: tuple[int, ...]
    bench_tokens: int
    copy_bytes: int
    cycles: int
    kernel_cases: tuple[str, ...] | None   # None: every case
    hf_compile: bool
    compile_mode: str                      # section compile_boot's engines (dry run: off, it proves the wiring)
    compile_models: tuple[tuple[str, dict], ...]   # its (name, shape) pairs, in the order they run
    big_model: dict                        # section decode_8b's shape


FULL = Profile("cuda", LLAMA_1B, 1024, (1, 2, 4, 8, 16, 32, 64), (128, 512), 16, 8, 32, (1, 8, 64), 128,
               1 << 30, 10, None, True, "auto",
               (("llama-1b", LLAMA_1B), ("smollm2-30", SMOLLM2_30)), LLAMA_8B)
DRY = Profile("cpu", TINY, 128, (1, 2, 4, 8, 64), (32, 64), 8, 4, 8, (1, 8, 64), 6, 32 << 20, 10,
              DRY_KERNEL_CASES, False, "off",
              (("llama-1b", TINY), ("smollm2-30", TINY_30)), TINY_BIG)


@dataclass
class Context:
    profile: Profile
    dry_run: bool
    work: Path
    deadline: float
    engine_compile: str                          # the big engine's compile option (see --engine-compile)
    shared: dict = field(default_factory=dict)   # what later sections reuse (models, the engine, numbers)

    def need(self, key: str, section: str):
        if key not in self.shared:
            raise RuntimeError(f"needs {key!r} from section {section!r}, which did not produce it")
        return self.shared[key]


GRACE_S = 40.0   # hf_decode may start a batch that ends this long after the budget
