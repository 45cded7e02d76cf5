"""EngineConfig: what the user asked the engine for, frozen and validated before any work starts.

Owns: the option names LLM(...) accepts, their defaults and their validation. Values derived from the
model and the machine (block counts, buckets, the resolved dtype) live in engine/boot.py's BootPlan,
never written back here.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from phaseflip.engine.validate import require


def _int_tuple(name: str, values) -> tuple[int, ...] | None:
    if values is None:
        return None
    out = tuple(values)
    require(len(out) > 0 and all(isinstance(v, int) and v >= 1 for v in out),
            f"{name}={values!r} is invalid: must be a non-empty list of integers >= 1")
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None            # HF-format directory or GGUF file; None = the embedded SmolLM2
    dtype: str = "auto"                 # float32 | bfloat16 | float16 | auto (float32 on CPU)
    block_products: str = "auto"        # GGUF blocks: int8 (x quantized per block, llama.cpp's numerics)
                                        # | exact (x as it is) | auto (int8 where the CPU has integer dots)
    device: str = "auto"                # cpu | cuda | auto
    max_model_len: int | None = None    # None = the model's max_position_embeddings
    max_num_seqs: int = 64              # sequences running at once
    max_num_batched_tokens: int = 512   # token budget of one step (= the prefill chunk size)
    block_size: int = 16                # tokens per KV block
    num_kv_blocks: int | None = None    # None = from kv_cache_memory_gib / gpu_memory_utilization
    kv_cache_memory_gib: float | None = None  # KV pool budget; None = 2.0 GiB on the CPU, on CUDA
                                              # what gpu_memory_utilization leaves
    gpu_memory_utilization: float | None = None  # CUDA: fraction of each device the engine may use
                                                 # (weights, graphs, activations, KV); None = 0.9
    seed: int = 0                       # base seed of sampling for requests without their own
    enable_prefix_caching: bool = True  # reuse the KV of cached full blocks of a shared prompt prefix
    enforce_eager: bool = False         # True: run every step uncaptured (debugging)
    decode_buckets: tuple[int, ...] | None = None   # batch sizes captured; None = 1,2,4,8,16,24,32,...
    prefill_buckets: tuple[int, ...] | None = None  # token counts captured; None = 32,64,...,budget
    num_threads: int | None = None      # torch intra-op threads on CPU; None = torch's default
    world_size: int = 1                 # ranks (processes, one device each); 1 stays in-process
    layouts: tuple[str, ...] | None = None  # captured layouts; None = ("pp", "tp") if world_size > 1
    flip_every_steps: int | None = None     # force a flip every K steps (tests); None = the drain rule
    park: str = "auto"                  # auto | always | never: where the inactive weight image waits
    flip_staging_mib: float | None = None  # the flip's KV staging (send + receive); None = the smaller
                                           # of 256 MiB and a tenth of the KV pool
    pp_split: tuple[int, ...] | None = None     # explicit PP layers per rank
    pp_micro_batches: int | None = None  # pieces a PP step is cut into at most, so that the stages
                                         # compute at once; None = twice the stages, 1 = no cut
    tp_kv_split: tuple[int, ...] | None = None  # explicit TP KV heads per rank
    rank_budgets: tuple[float, ...] | None = None  # relative capacity per rank (CPU simulation)
    rank_memory_gib: tuple[float, ...] | None = None  # memory budget per rank for the ledger (CPU);
                                                      # None = RAM / world_size (CPU), the device (CUDA)
    compile: str | None = None          # auto | on | off; None = $PHASEFLIP_COMPILE, else auto
    remeasure: bool = False             # measure the boot's choices though an earlier boot recorded them
    policy: str = "throughput"          # which layout runs next: throughput | latency | drain
    ttft_budget_s: float | None = None  # policy="latency": the time-to-first-token budget
    def __post_init__(self):
        require(self.dtype in ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "half"),
                f"dtype={self.dtype!r} is invalid: allowed are auto, float32, bfloat16, float16")
        require(self.block_products in ("auto", "int8", "exact"),
                f"block_products={self.block_products!r} is invalid: allowed are auto, int8, exact")
        require(self.device in ("auto", "cpu", "cuda"),
                f"device={self.device!r} is invalid: allowed are auto, cpu, cuda")
        require(self.max_model_len is None or self.max_model_len >= 2,
                f"max_model_len={self.max_model_len} is invalid: must be >= 2 (or None)")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            require(isinstance(getattr(self, name), int) and getattr(self, name) >= 1,
                    f"{name}={getattr(self, name)!r} is invalid: must be an integer >= 1")
        require(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
                f"num_kv_blocks={self.num_kv_blocks} is invalid: must be >= 1 (or None)")
        require(self.kv_cache_memory_gib is None or self.kv_cache_memory_gib > 0,
                f"kv_cache_memory_gib={self.kv_cache_memory_gib} is invalid: must be > 0 (or None)")
        require(self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
                f"gpu_memory_utilization={self.gpu_memory_utilization} is invalid: must be in (0, 1] (or None)")
        require(isinstance(self.enable_prefix_caching, bool),
                f"enable_prefix_caching={self.enable_prefix_caching!r} is invalid: must be True or False")
        require(self.num_threads is None or self.num_threads >= 1,
                f"num_threads={self.num_threads} is invalid: must be >= 1 (or None)")
        require(isinstance(self.world_size, int) and self.world_size >= 1,
                f"world_size={self.world_size!r} is invalid: must be an integer >= 1")
        require(self.park in ("auto", "always", "never"),
                f"park={self.park!r} is invalid: allowed are auto, always, never")
        require(self.flip_every_steps is None or self.flip_every_steps >= 1,
                f"flip_every_steps={self.flip_every_steps} is invalid: must be >= 1 (or None)")
        require(self.pp_micro_batches is None or (isinstance(self.pp_micro_batches, int) and self.pp_micro_batches >= 1),
                f"pp_micro_batches={self.pp_micro_batches!r} is invalid: must be an integer >= 1 (or None)")
        require(self.flip_staging_mib is None or self.flip_staging_mib > 0,
                f"flip_staging_mib={self.flip_staging_mib} is invalid: must be > 0 (or None)")
        self._check_layouts()
        require(self.policy in ("throughput", "latency", "drain"),
                f"policy={self.policy!r} is invalid: allowed are throughput, latency, drain")
        require((self.policy == "latency") == (self.ttft_budget_s is not None),
                f"ttft_budget_s={self.ttft_budget_s!r} is invalid with policy={self.policy!r}: "
                f"policy='latency' needs a ttft_budget_s > 0, the others take none")
        require(self.ttft_budget_s is None or self.ttft_budget_s > 0,
                f"ttft_budget_s={self.ttft_budget_s!r} is invalid: must be > 0 (seconds)")
        require(isinstance(self.remeasure, bool),
                f"remeasure={self.remeasure!r} is invalid: must be True or False")
        require(self.compile in (None, "auto", "on", "off"),
                f"compile={self.compile!r} is invalid: allowed are auto, on, off (or None)")
        for name in ("pp_split", "tp_kv_split", "rank_budgets", "rank_memory_gib"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))
                require(len(value) == self.world_size,
                        f"{name}={list(value)} has {len(value)} entries for world_size={self.world_size}")
        object.__setattr__(self, "decode_buckets", _int_tuple("decode_buckets", self.decode_buckets))
        object.__setattr__(self, "prefill_buckets", _int_tuple("prefill_buckets", self.prefill_buckets))
        require(self.decode_buckets is None or max(self.decode_buckets) <= self.max_num_seqs,
                f"decode_buckets={list(self.decode_buckets or ())} is invalid: a decode bucket is a batch "
                f"of sequences and cannot exceed max_num_seqs={self.max_num_seqs}")
        require(self.prefill_buckets is None or max(self.prefill_buckets) <= self.max_num_batched_tokens,
                f"prefill_buckets={list(self.prefill_buckets or ())} is invalid: a prefill bucket cannot "
                f"exceed max_num_batched_tokens={self.max_num_batched_tokens}")

    def _check_layouts(self) -> None:
        layouts = self.layouts
        if layouts is None:
            layouts = ("pp", "tp") if self.world_size > 1 else ("pp",)
        layouts = (layouts,) if isinstance(layouts, str) else tuple(layouts)
        require(len(layouts) > 0 and set(layouts) <= {"pp", "tp"} and len(set(layouts)) == len(layouts),
                f"layouts={self.layouts!r} is invalid: give ('pp', 'tp'), ('pp',) or ('tp',)")
        object.__setattr__(self, "layouts", layouts)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; "
                            f"known options: {', '.join(sorted(known))}")
        return cls(**kwargs)
