"""KV sized to the device: gpu_memory_utilization (vLLM's name and meaning), measured on each rank.

Owns: the profile step a rank runs after its weights and static buffers are in place and before its KV
region exists (the largest prefill bucket and the largest decode bucket of every layout, through the
serving path, sampling included, over a provisional KV of a few blocks), the block count that follows
from what the device measured, and the agreement of all ranks on the smallest one (block ids are shared).

The rule: the rank may use `utilization` of the device's total memory. What the device already uses
(weights, static buffers, the CUDA context, any other process) is read from the driver after the
profile's memory is given back; the KV gets what remains after the profile's peak (eager and host-
sampled steps allocate it again while serving), the CUDA graph pool (graphs are captured after the KV:
the profile's peak again, their scratch, plus the outputs every captured step keeps) and the flip's
staging. Every number goes into the report the boot prints and the manifest keeps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from phaseflip.rank.messages import NewRequest, Phase, SeqChunk, StepBatch
from phaseflip.rank.step_sampling import VARIANTS

PROFILE_SEQ_BASE = 1 << 62   # profile steps' sequence ids: never a request's


@dataclass(frozen=True)
class ProfileParams:
    """The sampling a profile step asks for: the costliest path (top-k, top-p and min-p all on)."""
    greedy: bool = False
    seed: int | None = 0
    temperature: float = 1.0
    top_k: int = 50
    top_k_enabled: bool = True
    top_p: float = 0.9
    min_p: float = 0.05
    logprobs: int | None = None
    prompt_logprobs: int | None = None   # its transient (64 rows of logits at a time) is not priced
    adjusts_logits: bool = False   # no penalties: the profile measures the recorded step's own paths


class CudaMemory:
    """The driver's and the caching allocator's view of one CUDA device."""
    def __init__(self, device: str):
        self.device = device

    def start_peak(self) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak_since(self, start: int) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - start

    def free_and_total(self) -> tuple[int, int]:
        torch.cuda.empty_cache()   # what the profile freed goes back to the driver before it is read
        return torch.cuda.mem_get_info(self.device)


def device_memory(device: str):
    if device == "cpu":
        raise ValueError("gpu_memory_utilization sizes the KV of a CUDA device; on the CPU give "
                         "kv_cache_memory_gib or num_kv_blocks")
    return CudaMemory(device)


def profile_batches(decode_bucket: int, prefill_bucket: int, max_model_len: int, block_size: int,
                  max_blocks_per_seq: int) -> list[StepBatch]:
    """The largest prefill bucket's tokens (as sequences of at most max_model_len tokens, each sampled)
    and the largest decode bucket's sequences (one token each). Every sequence writes the same few
    blocks: what they hold does not matter, only what the step allocates. Block tables are as wide as
    a serving step's (the CUDA attention sizes its context splits by their width)."""
    per_seq = min(prefill_bucket, max_model_len)
    used = -(-per_seq // block_size)
    table = tuple(range(used)) + (0,) * (max_blocks_per_seq - used)
    sizes = [per_seq] * (prefill_bucket // per_seq) + ([prefill_bucket % per_seq] if prefill_bucket % per_seq else [])
    prefill = tuple(SeqChunk(PROFILE_SEQ_BASE + i, (0,) * n, 0, table, True, False) for i, n in enumerate(sizes))
    decode = tuple(SeqChunk(PROFILE_SEQ_BASE + i, (0,), 0, table, True, True) for i in range(decode_bucket))
    batches = []
    for phase, chunks in ((Phase.PREFILL, prefill), (Phase.DECODE, decode)):
        news = tuple(NewRequest(c.seq_id, ProfileParams(), c.num_tokens) for c in chunks)
        batches.append(StepBatch(-1, phase, chunks, news, tuple(c.seq_id for c in chunks)))
    return batches


def profile_blocks(prefill_bucket: int, max_model_len: int, block_size: int) -> int:
    """Blocks of the provisional KV the profile steps write."""
    return -(-min(prefill_bucket, max_model_len) // block_size)


def run_profile(runners: dict, arena, sampler, batches: list[StepBatch]) -> list[dict]:
    """Each layout's profile steps, through the serving path (execute: head, gather, sampling)."""
    ran = []
    for name, runner in runners.items():
        arena.refill(name)
        for batch in batches:
            sampler.add_requests(batch.new_requests)
            try:
                runner.execute(batch)
            finally:
                for seq_id in batch.finished_seq_ids:
                    sampler.remove(seq_id)
            ran.append({"layout": name, "phase": batch.phase.value, "tokens": batch.num_tokens,
                        "seqs": batch.num_seqs})
    return ran


def kept_outputs_bytes(runner, dtype_bytes: int) -> int:
    """What the captured steps of one layout keep in the graph pool: each step's output (hidden states,
    or on a rank that samples in the step, picked ids and logits per sampling variant)."""
    s, cfg = runner.shapes, runner.cfg
    prefill = sum(t * cfg.hidden_size * dtype_bytes for t in s.prefill_buckets)
    if runner.samples_in_step:
        row = len(VARIANTS) * (cfg.vocab_size * dtype_bytes + 2 * 8)
    else:
        row = cfg.hidden_size * dtype_bytes
    return prefill + sum(b * row for b in s.decode_buckets)


def fit_blocks(utilization: float, free: int, total: int, peak: int, graph_pool: int, staging: int | None,
               staging_default: tuple[int, float], block_bytes: int) -> tuple[int, dict]:
    """Blocks of block_bytes that fit in utilization * total after what the device uses (total - free),
    the profile's peak, the graph pool and the staging (None: the default, min(cap, fraction * KV))."""
    room = int(utilization * total) - (total - free) - peak - graph_pool
    cap, fraction = staging_default
    if staging is None:   # kv + min(cap, fraction * kv) <= room
        kv = room - cap if room - cap >= cap / fraction else int(room / (1 + fraction))
    else:
        kv = room - staging
    blocks = max(0, kv // block_bytes)
    if staging is None:
        staging = min(cap, int(fraction * blocks * block_bytes))
    return blocks, {"utilization": utilization, "device_total": total, "device_used": total - free,
                    "profile_peak": peak, "graph_pool_estimate": graph_pool, "staging": staging,
                    "kv_bytes": blocks * block_bytes, "block_bytes": block_bytes, "fits_blocks": blocks}


def too_small(report: dict, max_model_len: int, one_seq: int) -> str:
    gib = 2**30
    need = one_seq * report["block_bytes"]
    return (f"gpu_memory_utilization={report['utilization']} leaves {report['kv_bytes'] / gib:.3f} GiB of KV "
            f"on rank {report['rank']} ({report['blocks']} blocks agreed by all ranks; the device holds "
            f"{report['device_total'] / gib:.2f} GiB, uses {report['device_used'] / gib:.2f} GiB with the "
            f"weights, the profile step peaks at {report['profile_peak'] / gib:.3f} GiB, graphs ~"
            f"{report['graph_pool_estimate'] / gib:.3f} GiB, flip staging {report['staging'] / gib:.3f} GiB), "
            f"but one sequence of max_model_len={max_model_len} tokens needs {one_seq} blocks "
            f"({need / gib:.3f} GiB): raise gpu_memory_utilization, lower max_model_len, or give "
            f"kv_cache_memory_gib")
