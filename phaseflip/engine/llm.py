"""LLM: the offline API, shaped like vLLM's (generate, chat, stats, shutdown, context manager).

Owns: booting the engine from an EngineConfig, validating and submitting requests, running the step
loop until they finish, and building RequestOutputs. Model maths, scheduling and sampling live elsewhere.

Every generate() ends settled, whether it returned or raised: no request state is left on the
controller or on a rank, every KV block is free, and the controller and the ranks agree on the active
layout (an interrupt may land after the ranks flipped and before the controller recorded it). A dead
engine refuses new work up front with EngineDeadError.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from phaseflip.engine.blocks import BlockAllocator
from phaseflip.engine.boot import kv_reason, make_plan, policy_key, rank_boot
from phaseflip.engine.config import EngineConfig
from phaseflip.engine.core import EngineCore
from phaseflip.engine.policy.control import LayoutControl
from phaseflip.engine.checkpoint.loader import load_model_config
from phaseflip.engine.checkpoint.tokenizer import load_tokenizer
from phaseflip.engine.ranks.group import EngineDeadError, LocalRanks, ProcessRanks
from phaseflip.engine.ranks.torchrun import TorchrunRanks
from phaseflip.rank.comm import env_rank
from phaseflip.engine.outputs import request_output
from phaseflip.engine.prompts import PreparedPrompt, prepare_prompts
from phaseflip.engine.requests import RequestOutput, Sequence
from phaseflip.engine.sampling_params import SamplingParams
from phaseflip.engine.scheduler import Scheduler, SchedulerConfig
from phaseflip.engine.checkpoint.generation_config import load_generation_defaults
from phaseflip.engine.manifest import build_manifest
from phaseflip.engine.policy.record import PolicyRecord
from phaseflip.engine.policy.rules import has_choice, make_rule
from phaseflip.rank.messages import ForgetRequests, LiveStateQuery, ManifestQuery, StatsQuery
from phaseflip.rank.timing import timed

log = logging.getLogger("phaseflip")


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        self.boot_ms: dict[str, float] = {}
        self._boot()
        self._ids = itertools.count()           # sequence ids
        self._request_ids = itertools.count()
        self._closed = False

    def _boot(self) -> None:
        cfg = self.config
        with timed(self.boot_ms, "load"):
            model_dir = cfg.model or _default_model_dir()
            mc = load_model_config(model_dir)
            self.tokenizer = load_tokenizer(model_dir)
            self.generation_defaults = load_generation_defaults(model_dir)
        with timed(self.boot_ms, "plan"):
            self.plan = make_plan(cfg, mc, str(model_dir))
        self.model_config = mc
        with timed(self.boot_ms, "ranks"):
            boot = rank_boot(cfg, self.plan)
            self.ranks = _start_ranks(boot, cfg.world_size)
        self._adopt_kv_blocks()
        shapes = self.plan.shapes
        self.allocator = BlockAllocator(self.plan.num_kv_blocks, shapes.block_size,
                                        prefix_caching=cfg.enable_prefix_caching)
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=shapes.max_num_seqs,
                                              max_num_batched_tokens=shapes.max_num_batched_tokens,
                                              max_prefill_chunk=shapes.max_num_batched_tokens,
                                              block_size=shapes.block_size,
                                              window=mc.least_window), self.allocator)
        self.policy_record = (PolicyRecord.load(policy_key(cfg, self.plan, mc), cfg.layouts, cfg.remeasure)
                              if has_choice(cfg.policy, cfg.layouts, cfg.flip_every_steps) else None)
        if self.policy_record is not None and self.policy_record.used:
            log.info("policy: rates and flip costs seeded from %s (made %s)", self.policy_record.path,
                     self.policy_record.made_at)
        rule = make_rule(cfg.policy, cfg.ttft_budget_s, cfg.layouts, cfg.flip_every_steps, scheduler,
                         self.plan.max_model_len, self.policy_record)
        self.control = LayoutControl(self.ranks, cfg.layouts, rule, self.allocator.carried_blocks)
        eos = set(mc.eos_token_ids) | set(self.generation_defaults.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        output_ranks = {name: self.plan.layout_plan.spec(name).output_rank for name in cfg.layouts}
        self.core = EngineCore(scheduler, self.ranks, output_ranks, self.control, self.tokenizer, frozenset(eos),
                               self.plan.max_model_len)
        log.info("phaseflip booted %s (%s, %s, world size %d, layouts %s): %s", model_dir, self.plan.device,
                 self.plan.dtype, cfg.world_size, ",".join(cfg.layouts),
                 ", ".join(f"{k} {v:.0f} ms" for k, v in self.boot_ms.items()))

    def _adopt_kv_blocks(self) -> None:
        """The block count the ranks allocated (they sized it themselves under gpu_memory_utilization)."""
        counts = {r.num_kv_blocks for r in self.ranks.ready}
        if len(counts) != 1 or (self.plan.num_kv_blocks is not None and counts != {self.plan.num_kv_blocks}):
            raise RuntimeError(f"the ranks allocated KV pools of {sorted(counts)} blocks; the plan said "
                               f"{self.plan.num_kv_blocks}")
        self.plan = dataclasses.replace(self.plan, num_kv_blocks=counts.pop())
        self.kv_sizing = [r.kv_sizing for r in self.ranks.ready]
        self.kv_sized_by = kv_reason(self.config, self.kv_sizing[0])
        log.info("KV pool: %d blocks of %d tokens = %d tokens (%s)", self.plan.num_kv_blocks,
                 self.plan.shapes.block_size, self.plan.num_kv_blocks * self.plan.shapes.block_size,
                 self.kv_sized_by)

    def flip(self, target: str) -> dict:
        """Flip to `target` ("pp" | "tp") now; returns the flip's log entry (components in ms, bytes)."""
        self._check_open()
        with self._settled():
            return self.control.flip(target)

    # -- the offline API ---------------------------------------------------------------------------
    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        self._check_open()
        prepared = self.prepare(prompts, sampling_params)
        with self._settled():
            requests = [self.submit(p) for p in prepared]
            with tqdm(total=sum(map(len, requests)), desc="Processed prompts",
                      disable=not use_tqdm or not requests) as bar:
                while self.core.has_unfinished():
                    bar.update(len(self.core.step().finished))
        return [request_output(seqs[0].request_id, seqs, self.tokenizer) for seqs in requests]

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's): what a call without
        sampling params gets."""
        return SamplingParams(**self.generation_defaults.sampling)

    def prepare(self, prompts, sampling_params=None) -> list[PreparedPrompt]:
        """Prompts as token ids with their params (None: get_default_sampling_params()), every one checked
        against this engine's limits."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        return prepare_prompts(prompts, sampling_params, self.tokenizer, vocab_size=self.model_config.vocab_size,
                               max_model_len=self.plan.max_model_len,
                               max_tokens_in_pool=self.core.scheduler.max_sequence_tokens(),
                               eos_token_ids=self.core.eos_token_ids)

    def submit(self, p: PreparedPrompt, request_id: str | None = None) -> list[Sequence]:
        """Queue one prompt's params.n samples, one sequence each. They are queued together, so with
        prefix caching the first computes the prompt and the others reuse its full blocks."""
        request_id = str(next(self._request_ids)) if request_id is None else request_id
        now = time.perf_counter()
        seqs = [Sequence(seq_id=next(self._ids), request_id=request_id, prompt_token_ids=p.token_ids,
                         params=params, arrival_time=now, prompt_text=p.prompt,
                         prompt_logprobs=None if params.prompt_logprobs is None else [None] * len(p.token_ids))
                for params in samples(p.params)]
        for seq in seqs:
            self.core.add(seq)
        return seqs

    @contextmanager
    def _settled(self):
        """Leave no request state behind, on a clean exit or a failure (see the module docstring)."""
        try:
            yield
        except BaseException:
            self.recover()
            raise
        finally:
            self.core.abort_all()  # no-op after a clean run; after a failure, frees every block
            if not self.ranks.dead:
                self.forget_finished()

    def recover(self) -> None:
        """After a failed step or flip: every request ends (its blocks free) and the controller takes
        the ranks' active layout; a dead engine stays dead."""
        self.core.abort_all()
        if not self.ranks.dead:
            self._agree_on_layout()

    def _agree_on_layout(self) -> None:
        """After a failure: take the ranks' active layout, which an interrupted flip may have changed."""
        active = {r.active_layout for r in self.ranks.call(StatsQuery())}
        if len(active) != 1:  # a flip's stages are agreed by every rank: this is an engine bug
            self.ranks.dead = f"the ranks disagree on the active layout ({sorted(active)})"
            self.ranks.shutdown()
            raise EngineDeadError(f"engine is dead: {self.ranks.dead}")
        self.control.active = active.pop()

    def forget_finished(self) -> None:
        """Ranks drop finished sequences' state when the next plan says so; with no next plan, now."""
        notices = self.core.scheduler.notices
        seq_ids = notices.pending_finished()
        if seq_ids:
            self.ranks.call(ForgetRequests(seq_ids))
            notices.told(seq_ids)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template: str | None = None, tools=None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts; content a str or OpenAI text parts) or a
        list of conversations, rendered by the model's chat template with vLLM's options."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        options = dict(continue_final_message=continue_final_message, chat_template=chat_template, tools=tools,
                       **(chat_template_kwargs or {}))
        encoded = [self.tokenizer.encode_chat(c, add_generation_prompt, **options) for c in conversations]
        outputs = self.generate([ids for _, ids in encoded], sampling_params, use_tqdm)
        return [dataclasses.replace(o, prompt=text if len(o.prompt_token_ids) == len(ids) else   # cut: what ran
                                    self.tokenizer.decode(o.prompt_token_ids, skip_special_tokens=False))
                for o, (text, ids) in zip(outputs, encoded)]

    # -- introspection and lifetime ----------------------------------------------------------------
    def stats(self) -> dict:
        ranks = self.ranks.call(StatsQuery())
        return {
            "active_layout": self.control.active,
            "world_size": self.config.world_size,
            "layouts": list(self.config.layouts),
            "steps": self.core.num_steps,
            "captures_at_boot": sum(r.captures_at_boot for r in ranks),
            "captures_after_boot": sum(r.captures_after_boot for r in ranks),
            "eager_fallbacks": dict(ranks[-1].eager_fallbacks),  # every rank runs the same steps
            "chunked_runs": dict(ranks[-1].chunked_runs),
            "micro_batched_runs": dict(ranks[-1].micro_batched_runs),
            "boot_ms": dict(self.boot_ms),
            "rank_boot_ms": [dict(r.boot_ms) for r in self.ranks.ready],
            "arena_bytes": [r.arena_bytes for r in ranks],
            "arena_ptrs": [r.arena_ptr for r in ranks],
            "shard_bytes": [dict(r.shard_bytes) for r in self.ranks.ready],
            "num_kv_blocks": self.plan.num_kv_blocks,
            "kv_sized_by": self.kv_sized_by,
            "free_kv_blocks": self.allocator.num_free_blocks,
            "num_preemptions": self.core.scheduler.num_preemptions,
            "window_freed_blocks": self.core.scheduler.num_window_freed_blocks,
            "prefix_cache": self.allocator.cache_stats(),
            "flips": self.control.num_flips,
            "failed_flips": self.control.num_failed_flips,
            "flip_log": list(self.control.flip_log),
            "decisions": list(self.control.rule.decisions),
            "num_decisions": self.control.rule.num_decisions,
            "rank_pids": list(self.ranks.pids),
            "request_state": {**self.core.scheduler.live_state(), "core_seqs": len(self.core.seqs)},
            "rank_sampler_seqs": [r.num_sampler_seqs for r in self.ranks.call(LiveStateQuery())],
        }

    def inspect(self) -> dict:
        """The boot manifest, live: layouts, ledgers, captured steps, boot phases, flips so far."""
        return build_manifest(self, self.ranks.call(ManifestQuery()))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM was shut down; create a new one")
        if self.ranks.dead:
            raise EngineDeadError(f"engine is dead: {self.ranks.dead}; create a new LLM")

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.control.rule.keep()
            except OSError as e:   # the cache unwritable: the next boot measures again
                log.warning("the policy's measurements were not kept: %s", e)
            self.ranks.shutdown()

    def __del__(self):
        ranks = getattr(self, "ranks", None)
        if ranks is not None and not getattr(self, "_closed", True):
            ranks.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def samples(params: SamplingParams) -> list[SamplingParams]:
    """The params of each of a request's params.n samples: a seeded request's sample i draws from
    seed + i (as vLLM's parallel sampling does), so its samples differ and each stays reproducible."""
    if params.n == 1:
        return [params]
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            for i in range(params.n)]


def _start_ranks(boot, world_size: int):
    if env_rank() is not None:  # launched by torchrun: this process is rank 0 and the controller
        if env_rank()[1] != world_size:
            raise ValueError(f"world_size={world_size} but torchrun started {env_rank()[1]} processes")
        return TorchrunRanks(boot, world_size)
    return LocalRanks(boot) if world_size == 1 else ProcessRanks(boot, world_size)


def _default_model_dir():
    from phaseflip.engine.checkpoint.default_model import ensure_default_model
    return ensure_default_model()
