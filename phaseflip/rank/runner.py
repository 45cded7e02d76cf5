"""One layout's step on one rank: fill the static buffers, replay the captured step, pass it on.

Owns: executing a StepBatch in one layout — PP: receive the hidden states from the previous stage, run
this stage's layers, send them to the next (explicit send/recv); TP: run every layer on this rank's
head/MLP share (all-reduces inside the maths), gather the vocab-parallel logits to the output rank.
The output rank (the last one in both layouts) samples; where it holds the whole vocabulary, a decode
step ends in the sampled ids (LM head and sampler inside the recorded step, one read of the ids by the
host; step_sampling.py). Replays the smallest captured bucket that fits (a compiled CPU prefill over
its own token rows, its graph being dynamic in them); a decode batch above every bucket replays the
largest CUDA graph chunk by chunk; any other uncaptured size runs eagerly and is counted. Which backend
each bucket records (compiled or eager, measured) is compile_choice.py's part.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from phaseflip.graphs.buffers import StaticBuffers
from phaseflip.graphs.capture import StepKey, capture_cuda, capture_eager
from phaseflip.graphs.compile import DirectStep
from phaseflip.graphs.registry import GraphRegistry
from phaseflip.graphs.saved_steps import SavedSteps
from phaseflip.kernels.cpu import quant
from phaseflip.kernels.cpu.linear import GEMV_ROWS, SMALL_BATCH
from phaseflip.rank.comm import NoComm, RankComm
from phaseflip.rank.compile_choice import CompileChoice
from phaseflip.rank.forward import StepState, compute_logits, final_softcap, forward
from phaseflip.rank.kvcache import KVView
from phaseflip.rank.model_config import ModelConfig
from phaseflip.rank.messages import Phase, PromptLogprobs, SampledToken, StepBatch
from phaseflip.rank.micro_batches import piece_sizes, split_step
from phaseflip.rank.prompt_logprobs import prompt_logprobs
from phaseflip.rank.sampler import Sampler
from phaseflip.rank.weights import RankWeights, Split
from phaseflip.rank.shard import RankShard
from phaseflip.rank.step_inputs import TOKEN_ROWS, bucket_rows, decode_rows, phase_buckets, prepare_inputs
from phaseflip.rank.step_sampling import cat_outputs, sampling_variants, variant_for


@dataclass(frozen=True)
class StepShapes:
    """The sizes the static buffers and the captured buckets are built for."""
    max_num_seqs: int
    max_num_batched_tokens: int
    max_blocks_per_seq: int
    block_size: int
    decode_buckets: tuple[int, ...]    # batch sizes (sequences)
    prefill_buckets: tuple[int, ...]   # tokens
    pp_micro_batches: int = 1          # pieces a PP step is cut into at most (micro_batches.py)

    @property
    def max_tokens(self) -> int:
        return max(self.max_num_batched_tokens, *self.decode_buckets, *self.prefill_buckets)


@dataclass(frozen=True)
class RankContext:
    """What one rank's runners share, whatever their layout: the model, the rank's index and step
    shapes, and the per-rank resources (one set of static buffers, graph registry, sampler, group)."""
    cfg: ModelConfig
    rank: int
    shapes: StepShapes
    rope_table: torch.Tensor
    local_rope_table: torch.Tensor | None   # the sliding layers' own rope (Gemma 3); None: rope_table
    buffers: StaticBuffers
    registry: GraphRegistry
    sampler: Sampler
    comm: RankComm | NoComm       # NoComm at world size 1


@dataclass(frozen=True)
class LayoutPart:
    """This rank's part in one layout: every rank's shard of it, where its logits are sampled, and the
    rank's weights and KV view in it."""
    layout: str
    shards: tuple[RankShard, ...]
    output_rank: int              # the layout spec's: where logits are sampled
    weights: RankWeights
    kv: KVView


class LayoutRunner:
    def __init__(self, ctx: RankContext, part: LayoutPart):
        self.layout, self.cfg, self.rank = part.layout, ctx.cfg, ctx.rank
        self.shards, self.shard = part.shards, part.shards[ctx.rank]
        self.weights, self.kv, self.rope_table = part.weights, part.kv, ctx.rope_table
        self.shapes, self.buffers, self.registry = ctx.shapes, ctx.buffers, ctx.registry
        self.sampler, self.comm = ctx.sampler, ctx.comm
        self.is_pp = self.shard.tp_size == 1 and len(self.shards) > 1
        self.output_rank = part.output_rank
        # The maths reduces partial sums over the ranks sharing a layer: nobody in PP.
        self.tp_comm = self.comm if self.shard.tp_size > 1 else NoComm()
        # which backend each (role, bucket) records, and the compiled steps (compile_choice.py)
        state = StepState(self.weights, self.cfg, self.shard, self.kv, self.rope_table, self.tp_comm,
                          ctx.local_rope_table)
        self.step_fn = functools.partial(forward, state)   # step_fn(meta, layer_fn=...): this layout's step
        self.compile = CompileChoice(self.layout, self.step_fn, state, self.buffers, self.shapes)
        # decode steps end in sampled ids where this rank samples from the whole vocabulary (set False
        # after boot: the recorded steps' logits are sampled on the host instead)
        self.samples_in_step = (self.rank == self.output_rank and self.shard.has_head
                                and self.shard.vocab.count == self.cfg.vocab_size)
        self.prompt_logprobs: list[PromptLogprobs] = []   # the last step's (execute)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of these rows: the compiled head where one was chosen for this few rows (CPU)."""
        head = self.compile.head if hidden.shape[0] <= GEMV_ROWS else None
        if head is not None:
            return head(self.weights.lm_head, hidden)
        return compute_logits(self.weights.lm_head, hidden, final_softcap(self.cfg))

    def _decode_fns(self, fn):
        """What a decode bucket records: the step itself, or on a rank that samples in the step, its
        sampling variants around it (step_sampling.VARIANTS: argmax only, up to every sampling path)."""
        return sampling_variants(fn, self.head) if self.samples_in_step else fn

    def layer_projections(self) -> list[tuple[torch.Tensor, ...]]:
        """Each layer's float projection weights, in the order a step multiplies them (none where the
        layers are quantized: their products take the quantized kernels, no measured forms)."""
        layers = [tuple(w for w, _ in _products(lw)) for lw in self.weights.layers]
        return [ws for ws in layers if not any(_quantized(w) for w in ws)]

    def projections(self):
        """(weight, bias, most rows it multiplies) of every float projection this layout runs: the step's
        up to max_tokens rows, the head's one row per sampled sequence (quantized ones: none of the
        forms' measurements or GEMMs apply)."""
        rows = self.shapes.max_tokens
        found = [(w, b, rows) for lw in self.weights.layers for w, b in _products(lw)]
        if self.shard.has_head:
            found.append((self.weights.lm_head, None, self.shapes.max_num_seqs))
        return [p for p in found if not _quantized(p[0])]

    def block_weights(self) -> list[torch.Tensor]:
        """The first layer's weights held in GGUF blocks (a Split's parts one by one), in the order a step
        multiplies them: what the boot times the block products' forms on (forms.choose_block_rows)."""
        if not self.weights.layers:
            return []
        found = [w for w, _ in _products(self.weights.layers[0]) if _quantized(w)]
        return [part for w in found for part in (w.parts if isinstance(w, Split) else (w,))]

    def capture_all(self, pool=None, stream=None) -> None:
        """Record one step per bucket of both phases (boot only): CUDA graphs when a pool is given."""
        if pool is not None and self.compile.measure_graphs:
            self.compile.choose_by_replay(pool, stream)
        for phase in Phase:
            for bucket, sizes in phase_buckets(self.shapes, phase):
                key = StepKey(self.layout, phase.value, bucket)
                backend, fn = self.compile.step_for(phase, bucket)
                if pool is None and backend == "compiled" and phase is Phase.DECODE and not isinstance(fn, SavedSteps):
                    fn = DirectStep(fn)   # the whole compiled step, replayed without dynamo once bound
                fn = self._decode_fns(fn) if phase is Phase.DECODE else fn
                if pool is not None:
                    step = capture_cuda(key, fn, self.buffers, bucket_rows(sizes), pool, stream)
                else:
                    step = capture_eager(key, fn, self.buffers, bucket_rows(sizes), backend=backend)
                self.registry.add(step)

    # Step kinds a decode batch above every bucket replays chunk by chunk. CUDA graphs: the uncaptured
    # step pays a launch per kernel (over ten times the graph step). Not the CPU's compiled step:
    # chunks read every weight once per chunk, and a decode step is bound by those reads, so one eager
    # step over all the rows is the faster.
    CHUNKED_BACKENDS = ("cuda",)

    def _run(self, batch: StepBatch, meta: dict[str, torch.Tensor], variant: str | None = None):
        """This stage's hidden states: a replay when a bucket fits, else an eager run. An eager replay
        runs at the exact size; a compiled prefill at its own token rows where a saved form serves them
        (_prefill_own_rows); any other over its padded bucket. Between PP stages
        only the real rows travel (padding rows of a padded receiver keep stale, never-read values).
        A decode batch above the largest decode bucket may run as chunks of that bucket (`_run_chunks`)."""
        chunk = self._decode_chunk(batch)
        if chunk is not None:
            return self._run_chunks(batch, meta, chunk, variant)
        size = batch.num_seqs if batch.phase is Phase.DECODE else batch.num_tokens
        step = self.registry.lookup(self.layout, batch.phase.value, size)
        padded = step is not None and not step.exact_size
        rows = batch.num_tokens
        if self.is_pp and not self.shard.has_embed:
            hidden_in = self.buffers.tensors["hidden_in"]
            self.comm.recv(hidden_in[:rows], self.rank - 1)
            meta["hidden_in"] = hidden_in[:step.views["input_ids"].shape[0] if padded else rows]
        hidden = self._replay(step, meta, variant)
        if self.is_pp and not self.shard.has_head:
            self.comm.send(hidden[:rows], self.rank + 1)
        return hidden

    def _replay(self, step, meta: dict[str, torch.Tensor], variant: str | None = None):
        """One step over meta's rows: an exact-size run (eager replay, or uncaptured when step is None),
        a compiled prefill over its own token rows, or the step's bucket filled (hidden_in too, unless it
        already lies in the buffer) and replayed."""
        if step is None or step.exact_size:
            device = self.kv.tensor.device
            exact = meta if device.type == "cpu" else {k: v.to(device) for k, v in meta.items()}
            if step is not None:
                return step.replay(exact, variant)
            return (self._decode_fns(self.step_fn)[variant] if variant else self.step_fn)(exact)
        for name, view in step.views.items():
            if name in meta and not (name == "hidden_in" and meta[name].data_ptr() == view.data_ptr()):
                self.buffers.fill(name, meta[name], view.shape[0])
        self.buffers.upload()
        if step.backend == "compiled" and step.key.phase == Phase.PREFILL.value:
            hidden = self._prefill_own_rows(step, meta["input_ids"].shape[0])
            if hidden is not None:
                return hidden
        return step.replay(variant=variant)

    def _prefill_own_rows(self, step, tokens: int) -> torch.Tensor | None:
        """A compiled prefill of `tokens` tokens (its bucket's views filled) over a prefix of the token
        rows rather than all of them, where a saved form serves it (CompileChoice.prefill_at_own_rows;
        None: replay the bucket). The sequences stay padded to the bucket's (the rows its graph was
        bound at). At least 2 token rows (1 would be a specialisation nothing bound at boot serves); where
        a few rows are not served (up to linear.SMALL_BATCH rows the products may take other forms than
        the graph traced at its bucket: its guards say whether), SMALL_BATCH + 1. A step that stops at a
        layer no saved form serves has written only K/V that the next try writes again."""
        bucket = step.views["input_ids"].shape[0]
        for rows in dict.fromkeys((max(tokens, 2), max(tokens, SMALL_BATCH + 1))):
            if rows >= bucket:
                return None
            views = {name: view[:rows] if name in TOKEN_ROWS else view for name, view in step.views.items()}
            hidden = self.compile.prefill_at_own_rows(views)
            if hidden is not None:
                step.replays += 1
                return hidden
        return None

    def _decode_chunk(self, batch: StepBatch) -> int | None:
        """The largest decode bucket where a decode batch exceeds it and that bucket's step is of a
        CHUNKED_BACKENDS kind, else None (the batch runs uncaptured at its own size)."""
        if batch.phase is not Phase.DECODE:
            return None
        largest = self.registry.largest(self.layout, batch.phase.value)
        if largest is None or batch.num_seqs <= largest:
            return None
        step = self.registry.lookup(self.layout, batch.phase.value, largest)
        return largest if step.backend in self.CHUNKED_BACKENDS else None

    def _run_chunks(self, batch: StepBatch, meta: dict[str, torch.Tensor], chunk: int, variant: str | None):
        """A decode batch above every bucket as replays of `chunk` sequences each (the rest in the bucket
        that fits it), not one uncaptured step: decode rows are independent (one token each, attending
        only its own sequence's cache), so the chunks give the rows the whole batch would. A later PP
        stage receives all rows first."""
        n = batch.num_seqs
        if self.is_pp and not self.shard.has_embed:
            buffer = self.buffers.tensors["hidden_in"]
            hidden_in = buffer.new_empty((n, buffer.shape[1]))
            self.comm.recv(hidden_in, self.rank - 1)
            meta = {**meta, "hidden_in": hidden_in}
        parts = []
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            step = self.registry.lookup(self.layout, batch.phase.value, b - a)   # the last chunk may be smaller
            parts.append(self._replay(step, decode_rows(meta, a, b), variant))
        self.registry.chunked_runs[(self.layout, batch.phase.value)] += 1
        hidden = cat_outputs(parts, [min(chunk, n - a) for a in range(0, n, chunk)])
        if self.is_pp and not self.shard.has_head:
            self.comm.send(hidden, self.rank + 1)
        return hidden

    def execute(self, batch: StepBatch) -> list[SampledToken] | None:
        """Run the step; the output rank returns the sampled tokens, the others None, and holds in
        `prompt_logprobs` those of the step's chunks that asked. A large enough PP step runs as
        micro-batches that follow each other through the stages (micro_batches.py)."""
        self.prompt_logprobs = []
        if not self.is_pp:
            return self._execute(batch)
        sizes = piece_sizes(batch.phase, batch.num_tokens, self.shapes.pp_micro_batches, self.kv.tensor.device.type)
        if len(sizes) == 1:
            return self._execute(batch)
        sampled = [self._execute(piece) for piece in split_step(batch, sizes)]
        self.registry.micro_batched_runs[(self.layout, batch.phase.value)] += 1
        return None if self.rank != self.output_rank else [s for part in sampled for s in part]

    def _execute(self, batch: StepBatch) -> list[SampledToken] | None:
        meta, sample_rows = prepare_inputs(batch, self.shapes.block_size)
        if batch.phase is Phase.DECODE and self.samples_in_step:
            seq_ids = [c.seq_id for c in batch.chunks]
            columns = self.sampler.step_columns(seq_ids, self.cfg.vocab_size)
            picked, logits = self._run(batch, {**meta, **columns}, variant_for(columns))
            return self.sampler.finish_in_step(picked, logits, seq_ids, columns)
        hidden = self._run(batch, meta)
        if batch.phase is not Phase.DECODE and self.shard.has_head:
            self.prompt_logprobs += prompt_logprobs(hidden, batch, self.sampler.prompt_logprobs_of, self._full_logits)
        if not self.shard.has_head or not sample_rows:
            return [] if self.rank == self.output_rank else None
        n = len(sample_rows)
        if isinstance(hidden, tuple):   # a decode recorded to end in logits, sampled on the host this time
            logits = hidden[1][:n]
        elif sample_rows == list(range(n)):   # a decode: every row samples; no index to copy to the device
            logits = self.head(hidden[:n])  # [N, V_r]
        else:
            logits = self.head(hidden[torch.tensor(sample_rows, device=hidden.device)])
        if self.shard.tp_size > 1:
            logits = self._gather_logits(logits)
        if self.rank != self.output_rank:
            return None
        return self.sampler.sample(logits, [c.seq_id for c in batch.chunks if c.sample])

    def _full_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The whole vocabulary's logits of these rows on the output rank (None elsewhere)."""
        logits = compute_logits(self.weights.lm_head, hidden, final_softcap(self.cfg))
        return self._gather_logits(logits) if self.shard.tp_size > 1 else logits

    def _gather_logits(self, logits: torch.Tensor) -> torch.Tensor | None:
        widths = [s.vocab.count for s in self.shards]
        pieces = self.comm.gather_rows(logits, self.output_rank, max(widths))
        if pieces is None:
            return None
        return torch.cat([p[:, :w] for p, w in zip(pieces, widths)], dim=1)   # [N, V]


def _quantized(weight) -> bool:
    """A weight in a GGUF block format, or a Split of such parts."""
    return isinstance(weight, Split) or quant.weight_format(weight) is not None


def _products(lw) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, bias) of each projection of a layer, in the order a step multiplies them; an MoE layer's
    router and its first expert's two products (every expert's have their shapes)."""
    found = [(lw.qkv_proj, lw.qkv_bias), (lw.o_proj, None)]
    if lw.router is not None:
        gate_up, down = lw.expert_weights()
        found += [(lw.router, None), (gate_up[0], None), (down[0], None)]
    if lw.gate_up_proj is not None:
        found += [(lw.gate_up_proj, None), (lw.down_proj, None)]
    return found
