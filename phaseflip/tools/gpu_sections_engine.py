"""The GPU check's engine sections: capture (boot of a Llama-3.2-1B-shaped model), replay_vs_eager,
park_restore, restore, decode_throughput, fp32_parity (against HF transformers) and hf_decode (HF
transformers' own decode rate), with the helpers they share: the random-weight checkpoint writer, prompts,
greedy sampling and the engine factory. Sections pass what later ones need through ctx.shared.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from phaseflip.tools.gpu_context import GRACE_S, Context, Profile
from phaseflip.tools.gpu_sections_device import sync_device


def write_model(out_dir: Path, shape: dict, device: str, seed: int = 0) -> Path:
    """An HF-format Llama checkpoint with random bf16 weights (drawn on `device`), config.json and the
    test tokenizer. Norm weights near 1, matrices std 0.02, embeddings std 1: varied greedy tokens."""
    import torch
    from safetensors.torch import save_file
    from tests.models import make_tokenizer
    make_tokenizer(out_dir)
    c = shape
    h, q, kv = c["hidden_size"], c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (c["intermediate_size"], h),
                       p + "mlp.up_proj.weight": (c["intermediate_size"], h),
                       p + "mlp.down_proj.weight": (h, c["intermediate_size"])})
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    if not c.get("tie_word_embeddings", True):
        shapes["lm_head.weight"] = (c["vocab_size"], h)
    for name, s in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.rand(s, generator=gen, device=device) * 0.4 + 0.8
        else:
            t = torch.randn(s, generator=gen, device=device) * (1.0 if "embed" in name else 0.02)
        tensors[name] = t.to(torch.bfloat16).cpu()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", **shape}
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    return out_dir


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(length + i % 5)] for i in range(n)]


def _greedy(max_tokens: int):
    from phaseflip.engine.sampling_params import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def engine_kwargs(p: Profile, model_dir: Path, **overrides) -> dict:
    """The LLM arguments every engine of the check shares (plain data: a child process gets them as JSON).
    A KV of 2 GiB: the engines share one process with each other and HF (section kv_sizing boots one
    with gpu_memory_utilization)."""
    kwargs = dict(model=str(model_dir), device=p.device, dtype="bfloat16", layouts=("pp", "tp"), park="always",
                  kv_cache_memory_gib=2.0,
                  max_model_len=p.max_model_len, max_num_seqs=max(p.bench_batches),
                  max_num_batched_tokens=max(p.prefill_buckets), decode_buckets=p.decode_buckets,
                  prefill_buckets=p.prefill_buckets, seed=0)
    kwargs.update(overrides)
    return kwargs


def _engine(ctx: Context, model_dir: Path, **overrides):
    from phaseflip import LLM
    return LLM(**engine_kwargs(ctx.profile, model_dir, **overrides))


def _first_mismatch(a: list[list[int]], b: list[list[int]]):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            pos = next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
            return {"sequence": i, "position": pos}
    return None


def capture(ctx: Context) -> dict:
    t0 = time.perf_counter()
    model_dir = write_model(ctx.work / "llama-1b-shape", ctx.profile.model, ctx.profile.device)
    write_s = time.perf_counter() - t0
    ctx.shared["model_dir"] = model_dir
    t0 = time.perf_counter()
    llm = ctx.shared["llm"] = _engine(ctx, model_dir, compile=ctx.engine_compile)
    boot_s = time.perf_counter() - t0
    stats = llm.stats()
    rank_ms = stats["rank_boot_ms"][0]
    out = {"ok": stats["captures_at_boot"] > 0, "model_write_s": write_s, "boot_s": boot_s,
           "engine_compile": ctx.engine_compile,
           "captures_at_boot": stats["captures_at_boot"], "arena_bytes": stats["arena_bytes"][0],
           "shard_bytes": stats["shard_bytes"][0], "boot_ms": stats["boot_ms"], "rank_boot_ms": rank_ms}
    manifest = llm.inspect() if hasattr(llm, "inspect") else None
    for layout in ("pp", "tp"):
        steps = [s for s in (manifest or {}).get("steps", []) if s.get("layout") == layout]
        pools = [s.get("pool_bytes") for s in steps]
        out[layout] = {
            "capture_ms": rank_ms.get(f"capture:{layout}"), "compile_ms": rank_ms.get(f"compile:{layout}"),
            "num_steps": len(steps) if manifest else None,
            "backends": sorted({s.get("backend") for s in steps}) if manifest else None,
            "graph_pool_bytes": sum(pools) if steps and None not in pools else None}
        if out[layout]["graph_pool_bytes"] is None:
            out[layout]["graph_pool_bytes_reason"] = ("no manifest (llm.inspect) in this build" if manifest is None
                                                      else "pool bytes not measured for these steps")
    if manifest:
        out["ledger"] = manifest["ranks"][0].get("ledger")
    return out


def replay_vs_eager(ctx: Context) -> dict:
    p, llm = ctx.profile, ctx.need("llm", "capture")
    prompts = ctx.shared["prompts"] = _prompts(p.num_prompts, p.prompt_len, seed=1)
    captured = ctx.shared["baseline"] = _tokens(llm.generate(prompts, _greedy(p.gen_tokens), use_tqdm=False))
    eager_llm = _engine(ctx, ctx.need("model_dir", "capture"), enforce_eager=True, compile="off")
    try:
        eager = _tokens(eager_llm.generate(prompts, _greedy(p.gen_tokens), use_tqdm=False))
    finally:
        eager_llm.shutdown()
    same = sum(a == b for a, b in zip(captured, eager))
    seeded = _seeded_in_step_vs_host(llm, prompts, p.gen_tokens)
    return {"ok": same == len(prompts) and seeded["num_identical"] == len(prompts), "num_prompts": len(prompts),
            "num_identical": same, "seeded_sampling": seeded,
            "first_mismatch": _first_mismatch(captured, eager), "eager_fallbacks": llm.stats()["eager_fallbacks"],
            "captured": f"compile={ctx.engine_compile!r} steps, "
                        f"{'CUDA graphs' if p.device == 'cuda' else 'recorded steps (CPU)'}",
            "eager": "enforce_eager=True, compile='off'"}


def _seeded_in_step_vs_host(llm, prompts, max_tokens: int) -> dict:
    """Seeded sampling inside the captured decode steps against the host sampler on the same engine (the
    runners told to sample the steps' logits on the host): the same tokens expected."""
    from phaseflip.engine.sampling_params import SamplingParams
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=i, max_tokens=max_tokens, ignore_eos=True)
              for i in range(len(prompts))]
    runners = list(llm.ranks.runtime.runners.values())
    in_step = _tokens(llm.generate(prompts, params, use_tqdm=False))
    was = [runner.samples_in_step for runner in runners]
    for runner in runners:
        runner.samples_in_step = False
    try:
        on_host = _tokens(llm.generate(prompts, params, use_tqdm=False))
    finally:
        for runner, flag in zip(runners, was):
            runner.samples_in_step = flag
    same = sum(a == b for a, b in zip(in_step, on_host))
    return {"num_identical": same, "first_mismatch": _first_mismatch(in_step, on_host),
            "params": "temperature 0.8, top_k 50, top_p 0.95, seed = prompt index"}


def park_restore(ctx: Context) -> dict:
    from phaseflip.rank.messages import PoisonArena   # the test hook tests/rank/test_flip.py uses
    p, llm, baseline = ctx.profile, ctx.need("llm", "capture"), ctx.need("baseline", "replay_vs_eager")
    ptrs0 = llm.stats()["arena_ptrs"]
    cycles = []
    for i in range(p.cycles):
        target = "tp" if llm.stats()["active_layout"] == "pp" else "pp"
        llm.ranks.call(PoisonArena())
        entry = llm.flip(target)
        outs = _tokens(llm.generate(ctx.shared["prompts"], _greedy(p.gen_tokens), use_tqdm=False))
        stats = llm.stats()
        cycles.append({"cycle": i, "target": target, "flip_ok": entry.get("ok"), "refill_ms": entry.get("refill_ms"),
                       "total_ms": entry.get("total_ms"), "weight_bytes": entry.get("weight_bytes"),
                       "identical": outs == baseline, "arena_ptrs": stats["arena_ptrs"]})
    ctx.shared["cycles"] = cycles
    stats = llm.stats()
    identical = all(c["identical"] for c in cycles)
    stable = all(c["arena_ptrs"] == ptrs0 for c in cycles)
    return {"ok": identical and stable and stats["captures_after_boot"] == 0, "cycles": len(cycles),
            "all_identical": identical, "arena_ptrs_stable": stable, "arena_ptrs": ptrs0,
            "captures_after_boot": stats["captures_after_boot"], "poisoned_before_each_refill": True,
            "per_cycle": cycles}


def restore(ctx: Context) -> dict:
    cycles = [c for c in ctx.need("cycles", "park_restore") if c["refill_ms"] is not None and c["weight_bytes"]]
    if not cycles:
        return {"ok": False, "refill_ms": None, "reason": "no flip reported a refill time and weight bytes"}
    refill_ms = statistics.median(c["refill_ms"] for c in cycles)
    weight_bytes = statistics.median(c["weight_bytes"] for c in cycles)
    floor_ms = weight_bytes / ctx.need("h2d_bw", "bandwidth") * 1e3
    return {"ok": True, "arena_bytes": ctx.shared["llm"].stats()["arena_bytes"][0],
            "weight_bytes_per_refill": weight_bytes, "refill_ms_median": refill_ms,
            "h2d_floor_ms": floor_ms, "ratio_to_floor": refill_ms / floor_ms,
            "flip_total_ms_median": statistics.median(c["total_ms"] for c in cycles)}


def decode_rates(llm, batches, prompt_len: int, new_tokens: int, runs: int = 3) -> dict[int, float]:
    """Decode tokens/s at each batch, the median of `runs` generates after an untimed one (on an H200 the
    first generate at a batch size ran at 0.4-0.6x the later ones, and later ones still spread ~15%).
    Token 0 comes from the prefill and token 1's step includes the flip to the decode layout, so each
    rate is measured from token 1 to the last token."""
    rates = {}
    for batch in batches:
        prompts = _prompts(batch, prompt_len, seed=100 + batch)
        llm.generate(prompts, _greedy(new_tokens), use_tqdm=False)
        rates[batch] = statistics.median(_decode_rate(llm.generate(prompts, _greedy(new_tokens), use_tqdm=False),
                                                      new_tokens) for _ in range(runs))
    return rates


def _decode_rate(outs, new_tokens: int) -> float:
    starts = [o.metrics.arrival_time + o.metrics.token_times[1] for o in outs]
    ends = [o.metrics.arrival_time + o.metrics.token_times[-1] for o in outs]
    return len(outs) * (new_tokens - 2) / (max(ends) - min(starts))


def decode_throughput(ctx: Context) -> dict:
    p, llm = ctx.profile, ctx.need("llm", "capture")
    stats = llm.stats()
    decode_layout = "tp"
    weight_bytes = stats["shard_bytes"][0][decode_layout]
    bw = ctx.shared.get("device_bw")
    rows = []
    for batch, tok_s in decode_rates(llm, p.bench_batches, p.prompt_len, p.bench_tokens).items():
        bound = None if bw is None else batch * bw / weight_bytes
        rows.append({"batch": batch, "tokens_per_s": tok_s, "bandwidth_bound_tokens_per_s": bound,
                     "fraction_of_bound": None if bound is None else tok_s / bound})
    ctx.shared["ours"] = {r["batch"]: r["tokens_per_s"] for r in rows}
    return {"ok": True, "decode_layout": decode_layout, "weight_bytes": weight_bytes, "new_tokens": p.bench_tokens,
            "device_bw_gb_s": None if bw is None else bw / 1e9, "rows": rows,
            "bound_rule": "batch * device bandwidth / weight bytes (KV reads ignored)",
            "eager_fallbacks": llm.stats()["eager_fallbacks"]}


def hf_decode(ctx: Context) -> dict:
    import torch
    import transformers
    p = ctx.profile
    if "llm" in ctx.shared:
        ctx.shared.pop("llm").shutdown()   # free the device for HF (the engine sections are done)
    model_dir = ctx.need("model_dir", "capture")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    model = model.to(device=p.device, dtype=torch.bfloat16).eval()   # older transformers: torch_dtype
    auto = hasattr(transformers, "CompileConfig")   # transformers compiles static-cache decoding itself
    how = "none (dry run on the CPU)" if not p.hf_compile else "generate auto-compile" if auto else "manual"
    if p.hf_compile and not auto:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    rows, last_s = [], 60.0   # a batch starts only if its compile fits before the deadline + GRACE_S
    for batch in p.bench_batches:
        if time.monotonic() + last_s > ctx.deadline + GRACE_S:
            rows.append({"batch": batch, "tokens_per_s": None, "reason": "time budget spent"})
            continue
        t_batch = time.monotonic()
        ids = torch.tensor(_prompts(batch, p.prompt_len, seed=7)[0][:p.prompt_len], device=p.device).repeat(batch, 1)

        def gen(n):
            sync_device(p.device)
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, cache_implementation="static",
                               pad_token_id=0, eos_token_id=None)
            sync_device(p.device)
            return time.perf_counter() - t0
        gen(p.bench_tokens)                          # warm-up: compiles for this batch size
        full, prefill = gen(p.bench_tokens), gen(1)  # decode = the difference
        rows.append({"batch": batch, "tokens_per_s": batch * (p.bench_tokens - 1) / (full - prefill),
                     "ours_tokens_per_s": ctx.shared.get("ours", {}).get(batch)})
        last_s = time.monotonic() - t_batch
    del model
    return {"ok": all(r["tokens_per_s"] is not None for r in rows), "compile": how, "cache": "static",
            "rows": rows, "new_tokens": p.bench_tokens,
            "rule": "decode tokens/s = batch * (N - 1) / (time(N new tokens) - time(1 new token)), after a warm-up"}


def fp32_parity(ctx: Context) -> dict:
    """A tiny Llama (llama3 rope) and a tiny Qwen3-MoE (the grouped Triton experts inside captured steps)."""
    from tests.models import compare_greedy, hf_greedy, make_tiny_model
    prompts = _prompts(4, 12, seed=3)
    models = {}
    for kind in ("llama3rope", "qwen3moe"):
        model_dir = make_tiny_model(kind, ctx.work / f"tiny-{kind}")
        with _engine(ctx, model_dir, dtype="float32", compile="off", max_model_len=256) as llm:
            ours = _tokens(llm.generate(prompts, _greedy(24), use_tqdm=False))
            captured = llm.stats()["captures_at_boot"]
        ok, ties, msg = compare_greedy(ours, hf_greedy(model_dir, prompts, 24))
        models[kind] = {"ok": ok, "tie_divergences": ties, "message": msg, "captures_at_boot": captured}
    return {"ok": all(m["ok"] for m in models.values()), "models": models,
            "engine": f"fp32 on {ctx.profile.device}, captured uncompiled steps (compile='off')",
            "reference": "HF transformers fp32 on the CPU, full recompute per token"}

