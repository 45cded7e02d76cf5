"""Boot planning: every value derived from the config, the model and the machine, computed once.

Owns: BootPlan (device, dtype, how products on GGUF blocks take x, max_model_len, KV block count, bucket
sets, the two layouts), the RankBoot message each rank boots from, and `policy_key` (what the policy's
recorded rates depend on).
Checkpoint problems are raised by the loader before any rank allocates its KV region, and a KV budget
that cannot hold one sequence of max_model_len tokens is refused here, saying what to change. On CUDA,
unless kv_cache_memory_gib or num_kv_blocks is given, the block count is left to the ranks: each
measures what gpu_memory_utilization leaves after its weights and a profile step (rank/kv_sizing.py),
and the LLM adopts the count they agreed on. An explicit num_kv_blocks is taken as given (a test and
tuning knob): a smaller pool is then every request's length limit (a warning says so).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass

import torch

from phaseflip.engine.config import EngineConfig
from phaseflip.cache import cache_dir
from phaseflip.engine.checkpoint.gguf_model import column_units, quantized_types
from phaseflip.engine.checkpoint.loader import resolve_dtype
from phaseflip.kernels.dispatch import triton_available
from phaseflip.rank.messages import RankBoot
from phaseflip.rank.model_config import ModelConfig
from phaseflip.rank.planner import LayoutPlan, kv_block_bytes, plan_layouts
from phaseflip.rank.runner import StepShapes

log = logging.getLogger("phaseflip")


@dataclass(frozen=True)
class BootPlan:
    model_dir: str
    device: str
    dtype: torch.dtype
    max_model_len: int
    num_kv_blocks: int | None   # None until the ranks sized it by kv_utilization (LLM adopts their count)
    shapes: StepShapes
    layout_plan: LayoutPlan
    budgets_bytes: tuple[int, ...] | None   # memory budget per rank (the ledger sums to it)
    kv_utilization: float | None = None     # gpu_memory_utilization the ranks size the KV by, if they do
    block_products: str | None = None       # "int8" | "exact" where weights are in GGUF blocks, else None


CPU_KV_GIB = 2.0                       # the CPU's KV pool when kv_cache_memory_gib is not given
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9   # vLLM's default


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device; use device='cpu'")
    return device


def resolve_compile(option: str | None) -> str:
    """The compile option a boot runs with: the one given, else $PHASEFLIP_COMPILE, else auto."""
    if option is not None:
        return option
    value = os.environ.get("PHASEFLIP_COMPILE", "auto")
    if value not in ("auto", "on", "off"):
        raise ValueError(f"PHASEFLIP_COMPILE={value!r} is invalid: allowed are auto, on, off")
    return value


def resolve_block_products(option: str, device: str, quantized: set[str]) -> str | None:
    """How the products on a model's GGUF blocks take x: "int8" (quantized per block of the weights' values,
    llama.cpp's numerics: the CPU kernels' integer dots) or "exact" (x as it is times the decoded weights);
    "auto" is int8 where the CPU kernels have integer dots (AVX2), else exact (CUDA's Triton kernels take x
    as it is). None for a model without blocks (`quantized` empty)."""
    if not quantized:
        return None
    from phaseflip.kernels.cpu import quant
    if option == "int8" and device != "cpu":
        raise ValueError(f"block_products='int8' is the CPU kernels' (integer dots): on {device} the Triton "
                         "kernels multiply x as it is; allowed there: auto, exact")
    if option == "int8" and not quant.has_int8_dot():
        raise ValueError("block_products='int8' needs the CPU kernels' integer dots, which this CPU or build "
                         "lacks (AVX2, and a C++ compiler); allowed here: auto, exact")
    if option == "auto":
        return "int8" if device == "cpu" and quant.has_int8_dot() else "exact"
    return option


def default_decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    small = [b for b in (1, 2, 4, 8, 16) if b < max_num_seqs]
    return tuple(small + list(range(24, max_num_seqs, 8)) + [max_num_seqs])


def default_prefill_buckets(budget: int) -> tuple[int, ...]:
    # Steps of 32 tokens keep padding waste small on the CPU, where a padded token costs real compute.
    return tuple(sorted(set(list(range(32, budget, 32)) + [budget])))


def device_budgets(device: str, world_size: int) -> tuple[float, ...]:
    """Free bytes per rank's device: NVML (nvidia-ml-py) on CUDA, torch as the fallback; on the CPU
    every rank is equal unless rank_budgets says otherwise."""
    if device != "cuda":
        return (1.0,) * world_size
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            return tuple(float(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).free)
                         for i in range(world_size))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 — no NVML: ask torch (this creates a context per device)
        return tuple(float(torch.cuda.mem_get_info(i)[0]) for i in range(world_size))


def memory_budgets(cfg: EngineConfig, device: str) -> tuple[int, ...] | None:
    """Bytes each rank may use: configured on the CPU (default: this machine's RAM shared equally),
    the device's total memory on CUDA (NVML, torch as the fallback)."""
    if cfg.rank_memory_gib is not None:
        return tuple(int(g * 2**30) for g in cfg.rank_memory_gib)
    if device == "cuda":
        try:
            return tuple(int(torch.cuda.get_device_properties(i).total_memory) for i in range(cfg.world_size))
        except Exception:  # noqa: BLE001 — unmeasured: the ledger says so
            return None
    try:
        with open("/proc/meminfo") as f:
            total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        return None
    return (total // cfg.world_size,) * cfg.world_size


def kv_utilization(cfg: EngineConfig, device: str) -> float | None:
    """The fraction of each device the ranks size the KV by (rank/kv_sizing.py), or None where the
    plan fixes the block count: num_kv_blocks or kv_cache_memory_gib given (they win), or the CPU."""
    if device != "cuda":
        if cfg.gpu_memory_utilization is not None:
            raise ValueError(f"gpu_memory_utilization={cfg.gpu_memory_utilization} applies to CUDA devices "
                             f"(device={device!r}): on the CPU the KV pool is kv_cache_memory_gib (default "
                             f"{CPU_KV_GIB} GiB) or num_kv_blocks")
        return None
    if cfg.num_kv_blocks is not None or cfg.kv_cache_memory_gib is not None:
        if cfg.gpu_memory_utilization is not None:
            log.warning("gpu_memory_utilization=%s is ignored: %s sizes the KV pool",
                        cfg.gpu_memory_utilization, "num_kv_blocks" if cfg.num_kv_blocks else "kv_cache_memory_gib")
        return None
    return cfg.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION


def _kv_blocks(cfg: EngineConfig, mc: ModelConfig, plan: LayoutPlan, dtype: torch.dtype,
               max_model_len: int) -> int:
    """Blocks every rank can hold in every captured view (the minimum: block ids are shared), from
    num_kv_blocks or kv_cache_memory_gib (CPU_KV_GIB where neither is given)."""
    one_seq = -(-max_model_len // cfg.block_size)
    if cfg.num_kv_blocks is not None:
        if cfg.num_kv_blocks < one_seq and not mc.least_window:   # windowed: the scheduler's bound
            log.warning("num_kv_blocks=%d holds %d tokens, less than max_model_len=%d: a request ends "
                        "(finish_reason 'length') when it fills the pool", cfg.num_kv_blocks,
                        cfg.num_kv_blocks * cfg.block_size, max_model_len)
        return cfg.num_kv_blocks
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    per_block = max(b for pp, tp in zip(plan.pp.shards, plan.tp.shards)
                    for name, b in zip(("pp", "tp"), kv_block_bytes(mc, pp, tp, cfg.block_size, dtype_bytes))
                    if name in cfg.layouts)
    gib = cfg.kv_cache_memory_gib or CPU_KV_GIB
    budget_blocks = int(gib * 2**30) // per_block
    if budget_blocks < one_seq:
        raise ValueError(_pool_too_small(cfg, gib, max_model_len, one_seq, budget_blocks, per_block))
    return min(budget_blocks, cfg.max_num_seqs * one_seq)  # more could never be used


def _pool_too_small(cfg: EngineConfig, gib: float, max_model_len: int, one_seq: int, budget_blocks: int,
                    per_block: int) -> str:
    need_gib = _round_up(one_seq * per_block / 2**30)
    fits = budget_blocks * cfg.block_size
    lower = f", or lower max_model_len to <= {fits}" if fits >= 2 else ""
    given = "" if cfg.max_model_len is not None else " (the model's maximum: max_model_len was not given)"
    return (f"the KV pool cannot hold one sequence of max_model_len={max_model_len}{given} tokens: it needs "
            f"{one_seq} blocks of {cfg.block_size} tokens ({per_block} bytes per block on the largest rank, "
            f"{need_gib} GiB), but kv_cache_memory_gib={gib} holds {budget_blocks} "
            f"blocks ({fits} tokens): raise kv_cache_memory_gib to >= {need_gib}{lower}")


def _round_up(x: float, digits: int = 3) -> float:
    """x rounded UP to `digits` significant digits (a budget quoted as enough must be enough)."""
    scale = 10 ** (digits - 1 - math.floor(math.log10(x)))
    return math.ceil(x * scale) / scale


def make_plan(cfg: EngineConfig, mc: ModelConfig, model_dir: str) -> BootPlan:
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device, mc.torch_dtype)
    if cfg.max_model_len is not None and cfg.max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len={cfg.max_model_len} is larger than the model's maximum "
                         f"{mc.max_position_embeddings} (max_position_embeddings in config.json)")
    max_model_len = cfg.max_model_len or mc.max_position_embeddings
    budgets = cfg.rank_budgets or device_budgets(device, cfg.world_size)
    quantized = quantized_types(model_dir)
    if quantized and device != "cpu" and not triton_available():
        raise ValueError(f"{model_dir}: weights stored as {', '.join(sorted(quantized))} are multiplied on "
                         f"{device} by Triton kernels, and triton is not installed; allowed without it: a GGUF "
                         "of F32 / F16 / BF16 tensors, or safetensors")
    block_products = resolve_block_products(cfg.block_products, device, quantized)
    layout_plan = plan_layouts(mc, budgets, pp_split=cfg.pp_split, tp_kv_split=cfg.tp_kv_split,
                               column_units=column_units(model_dir))
    budget = cfg.max_num_batched_tokens
    shapes = StepShapes(
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=budget,
        max_blocks_per_seq=-(-max_model_len // cfg.block_size), block_size=cfg.block_size,
        decode_buckets=cfg.decode_buckets or default_decode_buckets(cfg.max_num_seqs),
        prefill_buckets=cfg.prefill_buckets or default_prefill_buckets(budget),
        pp_micro_batches=cfg.pp_micro_batches or 2 * cfg.world_size)
    utilization = kv_utilization(cfg, device)
    num_blocks = None if utilization else _kv_blocks(cfg, mc, layout_plan, dtype, max_model_len)
    return BootPlan(model_dir, device, dtype, max_model_len, num_blocks, shapes, layout_plan,
                    memory_budgets(cfg, device), utilization, block_products)


def kv_reason(cfg: EngineConfig, sizing: dict | None) -> str:
    """Why the KV pool has the blocks it has, in words (the boot log's line)."""
    if cfg.num_kv_blocks is not None:
        return f"num_kv_blocks={cfg.num_kv_blocks} was given"
    if sizing is None:
        given = "" if cfg.kv_cache_memory_gib is not None else " (the CPU's default)"
        return f"kv_cache_memory_gib={cfg.kv_cache_memory_gib or CPU_KV_GIB}{given}"
    gib = 2**30
    return (f"gpu_memory_utilization={sizing['utilization']} of {sizing['device_total'] / gib:.2f} GiB on rank "
            f"{sizing['rank']}: {sizing['device_used'] / gib:.2f} GiB in use after the weights, profile step "
            f"peak {sizing['profile_peak'] / gib:.3f} GiB, graphs ~{sizing['graph_pool_estimate'] / gib:.3f} GiB, "
            f"flip staging {sizing['staging'] / gib:.3f} GiB; limited by {sizing['limited_by']}")


def rank_boot(cfg: EngineConfig, plan: BootPlan) -> RankBoot:
    return RankBoot(model_dir=plan.model_dir, dtype=str(plan.dtype).removeprefix("torch."),
                    device=plan.device, layout_plan=plan.layout_plan, layouts=cfg.layouts,
                    shapes=plan.shapes, num_kv_blocks=plan.num_kv_blocks, kv_utilization=plan.kv_utilization,
                    max_model_len=plan.max_model_len, park=cfg.park, seed=cfg.seed,
                    capture=not cfg.enforce_eager, num_threads=cfg.num_threads,
                    compile=resolve_compile(cfg.compile), compile_cache_dir=str(cache_dir() / "compile"),
                    remeasure=cfg.remeasure, block_products=plan.block_products,
                    budgets_bytes=plan.budgets_bytes,
                    flip_staging_bytes=None if cfg.flip_staging_mib is None else int(cfg.flip_staging_mib * 2**20))


# the options besides the plan that change a step's or a flip's time
POLICY_KEY_OPTIONS = ("world_size", "layouts", "num_threads", "park", "flip_staging_mib", "enforce_eager")


def policy_key(cfg: EngineConfig, plan: BootPlan, mc: ModelConfig) -> dict:
    """What the layout policy's measured rates and flip costs depend on (engine/policy/record.py): the
    machine and its GPUs, phaseflip's sources, torch, the model, the dtype and the whole plan (shapes,
    shards, KV pool), the compile mode and the options that change a step's or a flip's time."""
    from phaseflip.rank.boot_record import machine, source_digest
    gpus = ([torch.cuda.get_device_name(i) for i in range(cfg.world_size)] if plan.device.startswith("cuda")
            else None)
    return {"version": 1, "machine": machine(), "gpus": gpus, "torch": torch.__version__,
            "source": source_digest(), "model": repr(mc), "plan": repr(dataclasses.replace(plan, model_dir="")),
            "compile": resolve_compile(cfg.compile),
            "options": {name: getattr(cfg, name) for name in POLICY_KEY_OPTIONS}}
