"""One rank's step executor: static buffers, captured steps per bucket, replay, logits and sampling.

Owns: turning a StepPlan into a replay of the captured step of the smallest bucket that fits (an
uncaptured size runs eagerly and is counted), then logits for the sampled rows and the sampled tokens.
It holds references to the rank's weights and KV region; it never allocates either.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from phaseflip.graphs.buffers import StaticBuffers
from phaseflip.graphs.capture import StepKey, capture_eager
from phaseflip.graphs.registry import GraphRegistry
from phaseflip.layouts.forward import Comm, compute_logits, forward
from phaseflip.layouts.kvcache import KVCache
from phaseflip.layouts.model_config import ModelConfig
from phaseflip.layouts.plan import Phase, StepPlan, StepResult
from phaseflip.layouts.sampler import Sampler
from phaseflip.layouts.shard import RankWeights
from phaseflip.layouts.spec import RankShard
from phaseflip.layouts.step_inputs import buffer_specs, bucket_sizes, prepare_inputs


@dataclass(frozen=True)
class StepShapes:
    """The sizes the static buffers and the captured buckets are built for."""
    max_num_seqs: int
    max_num_batched_tokens: int
    max_blocks_per_seq: int
    block_size: int
    decode_buckets: tuple[int, ...]    # batch sizes (sequences)
    prefill_buckets: tuple[int, ...]   # tokens

    @property
    def max_tokens(self) -> int:
        return max(self.max_num_batched_tokens, *self.decode_buckets, *self.prefill_buckets)


class ModelExecutor:
    def __init__(self, cfg: ModelConfig, shard: RankShard, weights: RankWeights, kv: KVCache,
                 rope_table: torch.Tensor, shapes: StepShapes, sampler: Sampler, comm: Comm,
                 layout: str = "single"):
        self.cfg, self.shard, self.weights, self.kv = cfg, shard, weights, kv
        self.rope_table, self.shapes, self.sampler, self.comm = rope_table, shapes, sampler, comm
        self.layout = layout
        self.buffers = StaticBuffers(buffer_specs(shapes.max_tokens, shapes.max_num_seqs,
                                                  shapes.max_blocks_per_seq))
        self.registry = GraphRegistry()

    def step_fn(self, meta: dict[str, torch.Tensor]) -> torch.Tensor:
        return forward(self.weights, self.cfg, self.shard, meta, self.kv, self.rope_table, self.comm)

    def capture_all(self) -> None:
        """Record one step per bucket of both phases (boot only)."""
        s = self.shapes
        for b in s.decode_buckets:
            self._capture(StepKey(self.layout, Phase.DECODE.value, b), bucket_sizes(b, b))
        for t in s.prefill_buckets:
            self._capture(StepKey(self.layout, Phase.PREFILL.value, t), bucket_sizes(t, s.max_num_seqs))

    def _capture(self, key: StepKey, sizes: dict[str, int]) -> None:
        self.registry.add(capture_eager(key, self.step_fn, self.buffers, sizes))

    def run_step(self, plan: StepPlan, meta: dict[str, torch.Tensor]) -> torch.Tensor:
        """Hidden states [>= T, H] of the step: a replay when a bucket fits, else an eager run."""
        size = plan.num_seqs if plan.phase is Phase.DECODE else plan.num_tokens
        step = self.registry.lookup(self.layout, plan.phase.value, size)
        if step is None:
            return self.step_fn(meta)
        for name, view in step.views.items():
            self.buffers.fill(name, meta[name], view.shape[0])
        return step.replay()

    def execute(self, plan: StepPlan) -> StepResult:
        for req in plan.new_requests:
            self.sampler.add(req.seq_id, req.params)
        for seq_id in plan.finished_seq_ids:
            self.sampler.remove(seq_id)
        if not plan.chunks:
            return StepResult(plan.step_id, ())
        meta, sample_rows = prepare_inputs(plan, self.shapes.block_size)
        hidden = self.run_step(plan, meta)
        if not sample_rows:
            return StepResult(plan.step_id, ())
        logits = compute_logits(self.weights, hidden[torch.tensor(sample_rows)])
        seq_ids = [c.seq_id for c in plan.chunks if c.sample]
        return StepResult(plan.step_id, tuple(self.sampler.sample(logits, seq_ids)))
