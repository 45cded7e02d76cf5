"""Boot: load, plan, shard, allocate, capture — once — and report how long each phase took.

Owns: BootPlan (every value derived from the config, the model and the machine) and `boot`, which
returns a ready single-rank Engine runtime. Checkpoint problems are raised by the loader before the KV
cache is allocated.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from phaseflip.engine.config import EngineConfig
from phaseflip.engine.loader import load_model_config, load_tokenizer, load_weights, resolve_dtype
from phaseflip.kernels.rotary import cos_sin_table
from phaseflip.layouts.executor import ModelExecutor, StepShapes
from phaseflip.layouts.forward import NoComm
from phaseflip.layouts.kvcache import KVCache, KVShape
from phaseflip.layouts.model_config import ModelConfig
from phaseflip.layouts.sampler import Sampler
from phaseflip.layouts.shard import shard_weights
from phaseflip.layouts.spec import RankShard

log = logging.getLogger("phaseflip")


@dataclass(frozen=True)
class BootPlan:
    model_dir: str
    device: str
    dtype: torch.dtype
    max_model_len: int
    num_kv_blocks: int
    shapes: StepShapes


@dataclass
class BootReport:
    phases_ms: dict[str, float] = field(default_factory=dict)

    def timed(self, name: str):
        report = self

        class _Timer:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                report.phases_ms[name] = (time.perf_counter() - self.t0) * 1e3
        return _Timer()


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device; use device='cpu'")
    return device


def default_decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    small = [b for b in (1, 2, 4, 8, 16) if b < max_num_seqs]
    return tuple(small + list(range(24, max_num_seqs, 8)) + [max_num_seqs])


def default_prefill_buckets(budget: int) -> tuple[int, ...]:
    # Steps of 32 tokens keep padding waste small on the CPU, where a padded token costs real compute.
    return tuple(sorted(set(list(range(32, budget, 32)) + [budget])))


def _kv_blocks(cfg: EngineConfig, mc: ModelConfig, dtype: torch.dtype, max_model_len: int) -> int:
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    per_block = KVShape(mc.num_layers, 1, cfg.block_size, mc.num_kv_heads, mc.head_dim).bytes_per_block(dtype)
    budget_blocks = int(cfg.kv_cache_memory_gib * 2**30) // per_block
    enough = cfg.max_num_seqs * -(-max_model_len // cfg.block_size)  # more could never be used
    return max(1, min(budget_blocks, enough))


def make_plan(cfg: EngineConfig, mc: ModelConfig, model_dir: str) -> BootPlan:
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.max_model_len is not None and cfg.max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len={cfg.max_model_len} is larger than the model's maximum "
                         f"{mc.max_position_embeddings} (max_position_embeddings in config.json)")
    max_model_len = cfg.max_model_len or mc.max_position_embeddings
    num_blocks = _kv_blocks(cfg, mc, dtype, max_model_len)
    budget = cfg.max_num_batched_tokens
    shapes = StepShapes(
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=budget,
        max_blocks_per_seq=-(-max_model_len // cfg.block_size), block_size=cfg.block_size,
        decode_buckets=cfg.decode_buckets or default_decode_buckets(cfg.max_num_seqs),
        prefill_buckets=cfg.prefill_buckets or default_prefill_buckets(budget))
    return BootPlan(model_dir, device, dtype, max_model_len, num_blocks, shapes)


def build_executor(plan: BootPlan, mc: ModelConfig, hf: dict, report: BootReport,
                   seed: int, capture: bool) -> ModelExecutor:
    shard = RankShard.full(mc)
    with report.timed("pack"):
        weights = shard_weights({k: t.to(plan.device) for k, t in hf.items()}, mc, shard)
    with report.timed("kv_alloc"):
        kv = KVCache(KVShape(mc.num_layers, plan.num_kv_blocks, plan.shapes.block_size,
                             mc.num_kv_heads, mc.head_dim), plan.dtype, plan.device)
    rope = cos_sin_table(mc.head_dim, plan.max_model_len, mc.rope_theta, mc.rope_scaling).to(plan.device)
    executor = ModelExecutor(mc, shard, weights, kv, rope, plan.shapes, Sampler(seed), NoComm())
    if capture:
        with report.timed("capture"):
            executor.capture_all()
    executor.registry.seal()
    return executor
