"""The boot manifest: what was planned, captured and measured, as one JSON-ready dict.

Owns: assembling the manifest from the controller's plan and boot phases and every rank's report
(RankManifest): model and dtype, both layouts per rank, the memory ledger per rank and layout, how each
rank's weights are stored and the bytes a decode token reads, every
captured step, compile choices, boot phases, the last flips with their components (the flip log keeps
the last MAX_FLIP_LOG; num_flips and num_failed_flips count them all) and eager-fallback counts.
`llm.inspect()` returns it live; `phaseflip boot --manifest FILE` writes it; `phaseflip inspect` reads it.
"""
from __future__ import annotations

import dataclasses

VERSION = 1


def _span(s) -> list[int]:
    return [s.start, s.stop]


def _layouts(plan, layouts) -> dict:
    out = {}
    for name in layouts:
        spec = plan.layout_plan.spec(name)
        out[name] = [{"rank": r, "layers": _span(s.layers), "kv_heads": _span(s.kv_heads),
                      "mlp": _span(s.mlp), "vocab": _span(s.vocab), "has_embed": s.has_embed,
                      "has_head": s.has_head, "tp_size": s.tp_size,
                      **({"expert_mlp": _span(s.expert_mlp), "shared_mlp": _span(s.shared_mlp)}
                         if s.expert_mlp.count else {})} for r, s in enumerate(spec.shards)]
    return out


def build_manifest(llm, ranks: list) -> dict:
    cfg, plan, mc = llm.config, llm.plan, llm.model_config
    steps = [{"rank": r.rank, **st} for r in ranks for st in r.steps]
    fallbacks = dict(ranks[-1].eager_fallbacks)  # every rank runs the same steps
    return {
        "phaseflip_manifest": VERSION,
        "model": {"dir": plan.model_dir, **{k: v for k, v in dataclasses.asdict(mc).items()
                                            if k != "rope_scaling"}},
        "dtype": str(plan.dtype).removeprefix("torch."), "device": plan.device,
        "world_size": cfg.world_size, "active_layout": llm.control.active,
        "layouts": _layouts(plan, cfg.layouts),
        "plan": {"balanced": plan.layout_plan.balanced, "notes": list(plan.layout_plan.notes),
                 "kv_heads": list(plan.layout_plan.kv_heads), "layers": list(plan.layout_plan.layers)},
        "kv": {"num_blocks": plan.num_kv_blocks, "block_size": plan.shapes.block_size,
               "sized_by": llm.kv_sized_by, "sizing": llm.kv_sizing},
        "prefix_cache": llm.allocator.cache_stats(),
        "buckets": {"decode": list(plan.shapes.decode_buckets), "prefill": list(plan.shapes.prefill_buckets)},
        "pp_micro_batches": plan.shapes.pp_micro_batches,   # pieces a PP step is cut into at most
        "ranks": [{"rank": r.rank, "pid": r.pid, "device": r.device, "boot_ms": r.boot_ms,
                   "ledger": r.ledger, "compile": r.compile, "memory": r.memory, "weights": r.weights}
                  for r in ranks],
        "steps": steps,
        "boot_ms": dict(llm.boot_ms),
        "flips": list(llm.control.flip_log),
        "num_flips": llm.control.num_flips, "num_failed_flips": llm.control.num_failed_flips,
        "decisions": list(llm.control.rule.decisions),
        "policy_record": llm.policy_record.summary() if llm.policy_record else None,
        "eager_fallbacks": fallbacks,
        "chunked_runs": dict(ranks[-1].chunked_runs),   # batches above every bucket, run as its chunks
        "micro_batched_runs": dict(ranks[-1].micro_batched_runs),   # PP steps run as micro-batches
        "captures_at_boot": len(steps),
    }
