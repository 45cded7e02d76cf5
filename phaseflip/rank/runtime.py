"""RankRuntime: everything one rank owns after boot, and the commands it executes.

Owns: boot of one rank (its shards of every layout packed into host images, the weight arena and the
KV region allocated ONCE (under gpu_memory_utilization sized first by profile steps, kv_sizing.py),
every step of every layout captured), then StepBatch execution in the active layout, flips and stats.
The same code runs in-process at world size 1 and inside each rank process (rank/worker.py).
Checkpoint reading is passed in (`load`), so rank/ never imports engine/.
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Callable

import torch

from phaseflip.graphs.buffers import BufferSpec, StaticBuffers
from phaseflip.graphs.compile import import_compiler, use_cache_dir
from phaseflip.graphs.registry import GraphRegistry
from phaseflip.kernels.cpu import forms, fused_layer, linear, quant
from phaseflip.kernels.reference.rotary import cos_sin_table
from phaseflip.rank.boot_record import BootRecord, kernels_build, record_key
from phaseflip.rank.arena import (WeightArena, allocate_arena, arena_bases, experts_read, image_slots,
                                  pack_image, resident_images, weight_report)
from phaseflip.rank.comm import break_graphs_at_collectives
from phaseflip.rank.compile_choice import ONE_ROW_UNUSED
from phaseflip.rank.faults import Faults
from phaseflip.rank.flip import DEFAULT_STAGING_BYTES, DEFAULT_STAGING_FRACTION, allocate_staging, run_flip
from phaseflip.rank.kv_sizing import (device_memory, fit_blocks, kept_outputs_bytes, profile_blocks,
                                         profile_batches, run_profile, too_small)
from phaseflip.rank.kvcache import KVRegion, KVShape
from phaseflip.rank.messages import (FlipCommand, FlipReport, RankBoot, RankManifest, RankReady, RankStats,
                                        RunStep, StepReply)
from phaseflip.rank.model_config import ModelConfig
from phaseflip.rank.runner import LayoutPart, LayoutRunner, RankContext
from phaseflip.rank.sampler import Sampler
from phaseflip.rank.weights import RankWeights, shard_weights
from phaseflip.rank.step_inputs import buffer_specs
from phaseflip.rank.ledger import add_growth, graph_pool_bytes, measure_memory, rank_ledger, rss_growth
from phaseflip.rank.timing import timed

log = logging.getLogger("phaseflip")

Loader = Callable[[str, torch.dtype], tuple[ModelConfig, dict[str, torch.Tensor]]]


class RankRuntime:
    def __init__(self, boot: RankBoot, rank: int, comm, load: Loader,
                 progress: Callable[[str, float], None] | None = None):
        self.boot_ms: dict[str, float] = {}
        self.progress = progress or (lambda phase, ms: ms is None or log.info("rank %d: %s %.0f ms", rank, phase, ms))
        self.rank, self.comm, self.layouts = rank, comm, boot.layouts
        self.layout_plan = boot.layout_plan
        self.device = "cpu" if boot.device == "cpu" else f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
        if self.device != "cpu":
            torch.cuda.set_device(self.device)
        self.memory_at_start = measure_memory(self.device)  # the ledger's framework overhead
        self.compiler_import = (import_compiler(self.device, boot.compile_cache_dir) if boot.compile != "off"
                                else None)
        dtype = getattr(torch, boot.dtype)
        with self._timed("load"):
            self.cfg, hf = load(boot.model_dir, dtype)
        with self._timed("pack"):
            templates = {name: shard_weights(hf, self.cfg, self.layout_plan.spec(name).shards[rank])
                         for name in boot.layouts}
            images, buffer, resident = self._pack(boot, templates)
            del hf
        self.shard_bytes = {name: img.num_bytes for name, img in images.items()}
        with self._timed("arena"):
            self.arena = WeightArena(images, templates, self.device, resident, buffer)
        del templates  # views of the checkpoint: its pages leave the RSS with them
        self.kv_block_size = boot.shapes.block_size
        self.sampler = Sampler(boot.seed)
        self._make_buffers(boot, dtype)
        self.kv_sizing: dict | None = None   # how gpu_memory_utilization sized the KV (None: it did not)
        self.num_kv_blocks = boot.num_kv_blocks
        if self.num_kv_blocks is None:
            with self._timed("kv_profile"):
                self.kv_sizing = self._size_kv(boot, dtype)
            self.num_kv_blocks = self.kv_sizing["blocks"]
        with self._timed("kv_alloc"):
            self.kv = self._kv_region(boot, dtype, self.num_kv_blocks)
            self.staging = allocate_staging(self.layout_plan, boot.layouts, self.cfg.head_dim,
                                            boot.shapes.block_size, self.num_kv_blocks, dtype, self.device,
                                            boot.flip_staging_bytes)
        self.faults = Faults(rank)
        for fault in boot.faults:
            self.faults.arm(fault)
        self.registry = GraphRegistry()
        self.runners = self._make_runners(boot, self.kv, self.registry)
        self.host_image_bytes = sum(img.num_bytes for img in images.values() if not img.in_arena)
        # RSS the CPU GEMM warm-up (and the product forms' measurement) and compiling added; the CUDA
        # graph pool's segments
        self.gemm_bytes = self.compile_bytes = 0
        self.graph_pool_bytes: int | None = None
        self._capture(boot)
        self.active = boot.layouts[0]
        self.arena.refill(self.active)
        self.registry.seal()
        self.budget_bytes = boot.budgets_bytes[rank] if boot.budgets_bytes else None
        self.memory = measure_memory(self.device)

    def _pack(self, boot: RankBoot, templates: dict[str, RankWeights]):
        """Each layout's host image; on the CPU with both resident (the host is the device), packed
        straight into the arena, which is then allocated here. Returns (images, that arena or None,
        resident)."""
        sizes = {name: image_slots(w)[1] for name, w in templates.items()}
        resident = resident_images(boot.park, boot.device, sizes)
        bases, num_bytes = arena_bases(sizes, resident)
        buffer = allocate_arena(num_bytes, "cpu") if resident and self.device == "cpu" else None
        images = {name: pack_image(w, pin=self.device != "cpu",
                                   into=None if buffer is None else buffer[bases[name]:])
                  for name, w in templates.items()}
        return images, buffer, resident

    @contextmanager
    def _timed(self, phase: str):
        """Time a boot phase and report its start and its time (a progress bar on a terminal, log lines
        elsewhere)."""
        self.progress(phase, None)
        with timed(self.boot_ms, phase):
            yield
        self.progress(phase, self.boot_ms[phase])

    def _kv_region(self, boot: RankBoot, dtype: torch.dtype, num_blocks: int) -> KVRegion:
        shapes = {}
        for name in boot.layouts:
            shard = self.layout_plan.spec(name).shards[self.rank]
            shapes[name] = KVShape(shard.layers.count, num_blocks, boot.shapes.block_size,
                                   shard.kv_heads.count, self.cfg.head_dim)
        return KVRegion(shapes, dtype, self.device)

    def _make_buffers(self, boot: RankBoot, dtype: torch.dtype) -> None:
        """One set of static buffers per rank, shared by both layouts, and the rotary table."""
        s = boot.shapes
        specs = buffer_specs(s.max_tokens, s.max_num_seqs, s.max_blocks_per_seq)
        specs["hidden_in"] = BufferSpec((s.max_tokens, self.cfg.hidden_size), dtype, 0)
        self.buffers = StaticBuffers(specs, self.device)
        self.rope = cos_sin_table(self.cfg.head_dim, boot.max_model_len, self.cfg.rope_theta,
                                  self.cfg.rope_scaling).to(self.device)
        local = self.cfg.gemma.local_rope_theta if self.cfg.gemma else None   # Gemma 3's sliding layers
        self.local_rope = None if local is None else cos_sin_table(self.cfg.head_dim, boot.max_model_len,
                                                                   local).to(self.device)

    def _make_runners(self, boot: RankBoot, kv: KVRegion, registry: GraphRegistry) -> dict[str, LayoutRunner]:
        ctx = RankContext(self.cfg, self.rank, boot.shapes, self.rope, self.local_rope, self.buffers, registry,
                          self.sampler, self.comm)
        return {name: LayoutRunner(ctx, self._layout_part(name, kv)) for name in boot.layouts}

    def _size_kv(self, boot: RankBoot, dtype: torch.dtype) -> dict:
        """The KV block count by gpu_memory_utilization (kv_sizing.py): profile steps over a provisional
        KV of a few blocks, what the device then uses, every rank's count agreed to the smallest."""
        s = boot.shapes
        probe = device_memory(self.device)
        provisional = self._kv_region(boot, dtype, profile_blocks(max(s.prefill_buckets), boot.max_model_len,
                                                                  s.block_size))
        runners = self._make_runners(boot, provisional, GraphRegistry())
        batches = profile_batches(max(s.decode_buckets), max(s.prefill_buckets), boot.max_model_len, s.block_size,
                              s.max_blocks_per_seq)
        start = probe.start_peak()
        profiled = run_profile(runners, self.arena, self.sampler, batches)
        peak = probe.peak_since(start)
        element = provisional.buffer.element_size()
        block_bytes = provisional.block_stride * element
        graphs = self.device != "cpu" and boot.capture   # the graph pool: scratch + every step's output
        graph_pool = (peak + sum(kept_outputs_bytes(r, element) for r in runners.values())) if graphs else 0
        del runners, provisional
        free, total = probe.free_and_total()
        staging = 0 if len(boot.layouts) < 2 else boot.flip_staging_bytes
        fits, report = fit_blocks(boot.kv_utilization, free, total, peak, graph_pool, staging,
                                  (DEFAULT_STAGING_BYTES, DEFAULT_STAGING_FRACTION), block_bytes)
        blocks = self.comm.min(fits)   # beyond what running sequences use, blocks keep cached prefixes
        report.update(rank=self.rank, profiled=profiled, blocks=blocks, tokens=blocks * s.block_size,
                      limited_by="this rank's memory" if blocks == fits else "another rank's memory")
        if blocks < s.max_blocks_per_seq:
            raise ValueError(too_small(report, boot.max_model_len, s.max_blocks_per_seq))
        return report

    def _layout_part(self, name: str, kv: KVRegion) -> LayoutPart:
        spec = self.layout_plan.spec(name)
        return LayoutPart(name, spec.shards, spec.output_rank, self.arena.weights[name], kv.view(name))

    def _capture(self, boot: RankBoot) -> None:
        """Compile each layout's roles, then capture every bucket with that layout's image in the
        arena (its graphs read arena addresses). One graph pool per rank serves both layouts."""
        cuda = self.device != "cpu"
        self.pool = torch.cuda.graph_pool_handle() if cuda and boot.capture else None
        stream = torch.cuda.Stream(self.device) if self.pool is not None else None
        if boot.compile != "off":
            with self._timed("compiler_import"):   # the part of the imports the phases before did not hide
                self.compiler_import.join()
            break_graphs_at_collectives()
            if boot.compile_cache_dir is not None:
                self.compile_caches = use_cache_dir(boot.compile_cache_dir)
        if not cuda and boot.block_products is not None:   # a process setting, read by products on blocks
            quant.set_int8_x(boot.block_products == "int8")
        for name in boot.layouts:
            self.arena.refill(name)
            runner = self.runners[name]
            with self._timed(f"gemm_warm:{name}"), rss_growth() as grown:
                kernels = kernels_build(self.device)   # loads the CPU kernels (once) the products call
                key = record_key(runner, self.device, boot.compile, kernels, boot.block_products)
                record = BootRecord.load(key, boot.remeasure)
                if not cuda and runner.layer_projections():   # bf16's ladder form decides what `warm` builds
                    runner.compile.report["ladder"] = forms.choose_ladder_form(
                        list(runner.layer_projections()[0]), model=runner.cfg, recorded=record.get("ladder"))
                recorded_forms = not cuda and bool(record.reports)
                if recorded_forms:   # the forms first: `warm` builds only the GEMMs they take
                    self._choose_forms(runner, boot, record)
                gemms = linear.warm(runner.projections())
            self.gemm_bytes = add_growth(self.gemm_bytes, grown)
            if not cuda:   # measured after the warm (no GEMM built while timed), once per process, dtype and
                with self._timed(f"forms:{name}"), rss_growth() as grown:   # model: later layouts reuse
                    if not recorded_forms:
                        self._choose_forms(runner, boot, record)
                self.gemm_bytes = add_growth(self.gemm_bytes, grown)   # the products' scratch, as the warm-up's
            with self._timed(f"compile:{name}"), rss_growth() as grown:
                runner.compile.prepare(boot.compile, cuda, record)
            self.compile_bytes = add_growth(self.compile_bytes, grown)
            with self._timed(f"capture:{name}"):
                self.faults.check("capture")
                if boot.capture:
                    runner.capture_all(self.pool, stream)
            used = bool(record.reports)
            if not used:
                record.save(runner.compile.report)
            runner.compile.report["record"] = record.summary(used)
            log.info("rank %d: layout %s: %d GEMMs warmed, compiled (%s), captured %d steps in %.0f ms",
                     self.rank, name, gemms,
                     ", ".join(f"{k}: {v['choice']}" for k, v in runner.compile.report.items() if "choice" in v),
                     sum(1 for st in self.registry.steps() if st.key.layout == name),
                     self.boot_ms[f"capture:{name}"])
        if self.pool is not None:
            self.graph_pool_bytes = graph_pool_bytes(self.pool)

    @staticmethod
    def _choose_forms(runner: LayoutRunner, boot: RankBoot, record: BootRecord) -> None:
        """The product forms of this layout's weights (CPU): measured, or taken from the record."""
        weights = [w for w, _, _ in runner.projections()]
        report = runner.compile.report
        if weights:   # none where every product is on quantized weights (the quantized kernels)
            report["small_rows"] = forms.choose_small_forms(weights, model=runner.cfg,
                                                            recorded=record.get("small_rows"))
            report["wide_rows"] = forms.choose_wide_forms(weights, model=runner.cfg,
                                                          recorded=record.get("wide_rows"))
        blocks = runner.block_weights()
        if blocks:
            report["block_rows"] = forms.choose_block_rows(blocks, runner.weights.dtype, model=runner.cfg,
                                                           recorded=record.get("block_rows"))
        layers = runner.layer_projections()
        if boot.compile != "off" and layers and runner.compile.compiles_one_row(boot.compile):
            report["gemv"] = forms.choose_gemv(layers, model=runner.cfg, recorded=record.get("gemv"))
        elif boot.compile != "off" and layers:
            report["gemv"] = {"choice": linear.chosen(layers[0][0].dtype).one_row, "ms": None,
                              "reason": ONE_ROW_UNUSED}
        if runner.weights.layers:
            report["fused_layers"] = fused_layer.report(runner.weights.layers[0].qkv_proj.dtype,
                                                        runner.shard.tp_size, runner.weights.plain)

    # -- commands ------------------------------------------------------------------------------
    def run_step(self, cmd: RunStep) -> StepReply:
        if cmd.layout != self.active or self.arena.active != self.active:
            raise RuntimeError(f"rank {self.rank}: step for layout {cmd.layout!r} but the arena holds "
                               f"{self.arena.active!r} (active {self.active!r})")
        self.faults.check("step")
        batch = cmd.batch
        self.sampler.add_requests(batch.new_requests)
        for seq_id in batch.finished_seq_ids:
            self.sampler.remove(seq_id)
        runner = self.runners[self.active]
        sampled = runner.execute(batch) if batch.chunks else []
        return StepReply(self.rank, None if sampled is None else tuple(sampled),
                         tuple(runner.prompt_logprobs) if batch.chunks else ())

    def flip(self, cmd: FlipCommand) -> FlipReport:
        if cmd.target not in self.runners:
            raise ValueError(f"cannot flip to {cmd.target!r}: captured layouts are {', '.join(self.runners)}")
        return run_flip(self, cmd)

    def ready(self) -> RankReady:
        return RankReady(self.rank, dict(self.boot_ms), self.registry.captures_at_boot, self.arena.num_bytes,
                         dict(self.shard_bytes), self.kv.num_bytes, os.getpid(), self.num_kv_blocks,
                         self.kv_sizing)

    def manifest(self) -> RankManifest:
        num_blocks = self.num_kv_blocks
        steps = [{"layout": st.key.layout, "phase": st.key.phase, "bucket": st.key.bucket,
                  "backend": st.backend, "capture_ms": st.capture_ms, "pool_bytes": st.pool_bytes,
                  "replays": st.replays, "buffers": st.buffer_shapes()} for st in self.registry.steps()]
        stats = self.stats()
        return RankManifest(
            rank=self.rank, pid=os.getpid(), device=self.device, active_layout=self.active,
            boot_ms=dict(self.boot_ms), ledger={name: rank_ledger(self, name, num_blocks) for name in self.runners},
            steps=steps, compile={name: dict(r.compile.report) for name, r in self.runners.items()},
            memory=dict(self.memory), eager_fallbacks=stats.eager_fallbacks, chunked_runs=stats.chunked_runs,
            micro_batched_runs=stats.micro_batched_runs,
            weights={name: weight_report(img, experts_read(self.cfg), self.device)
                     for name, img in self.arena.images.items()})

    def stats(self) -> RankStats:
        return RankStats(self.rank, self.active, self.registry.captures_at_boot,
                         self.registry.captures_after_boot,
                         {f"{k[0]}:{k[1]}": v for k, v in self.registry.eager_fallbacks.items()},
                         {f"{k[0]}:{k[1]}": v for k, v in self.registry.chunked_runs.items()},
                         {f"{k[0]}:{k[1]}": v for k, v in self.registry.micro_batched_runs.items()},
                         self.arena.buffer.data_ptr(), self.arena.num_bytes)
