"""Every Triton kernel against its torch reference, case by case, on any device.

Owns: the case list (`CASES`, name -> check) shared by the CPU tests (tests/kernels/, through Triton's
interpreter) and the GPU check (phaseflip/tools/gpu_check.py, real launches), and the paged-batch
builder the attention cases use. A check raises AssertionError on a mismatch and returns its maximum
absolute error. The references always run on the CPU in float32 (the attention reference builds its
masks on the CPU); kernels run on `device` in the case's dtype. bf16 is compared with a tolerance, not
bit for bit: Triton's interpreter truncates float32 -> bf16 where the GPU rounds to nearest.

Importing this module imports no triton: each check imports its kernel module when it runs (so the
caller decides TRITON_INTERPRET before the first import).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from phaseflip.kernels.reference import activation, norm, rotary
from phaseflip.kernels.reference import moe as moe_ref
from phaseflip.kernels.reference import quant as quant_ref
from phaseflip.kernels.reference.attention import paged_attention_ref, store_kv

QUANT_TYPES = {"Q8_0": 8, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q4_K": 12, "Q6_K": 14}   # GGML's ids
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}   # (atol, rtol) vs a float32 reference


@dataclass(frozen=True)
class Llama3Scaling:
    """The fields cos_sin_table reads from a RopeScaling (rank/ is out of kernels/' reach)."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 64


def _compare(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, exact: bool = False) -> float:
    got, ref = got.detach().float().cpu(), ref.detach().float().cpu()
    assert got.shape == ref.shape, f"shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    if exact:
        torch.testing.assert_close(got, ref, atol=0, rtol=0)
    else:
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
    return float((got - ref).abs().max()) if got.numel() else 0.0


# -- paged batches ---------------------------------------------------------------------------------
def build_paged(seqs, hq: int, hkv: int, d: int, page: int, *, pad_tokens: int = 0, pad_seqs: int = 0,
                dtype=torch.float32, device="cpu", seed: int = 0, spare_blocks: int = 3) -> dict:
    """seqs: [(cached_len, new_len)]: the cached history is already in the pages (scattered over
    random block ids), the new tokens' K/V are in k/v and get stored at slot_mapping. Padding tokens
    have slot -1, padding sequences seq_len 0 (their query_start_loc entries repeat the last offset).
    Returns the op's keyword arguments."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil((c + n) / page) for c, n in seqs) + spare_blocks
    kc = torch.randn(num_blocks, page, hkv, d, generator=g)   # garbage outside the sequences' slots
    vc = torch.randn(num_blocks, page, hkv, d, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    qs, ks, vs, slots, tables, lens, starts = [], [], [], [], [], [], [0]
    for cached, new in seqs:
        total = cached + new
        blocks = [free.pop() for _ in range(math.ceil(total / page))]
        for p in range(cached):
            kc[blocks[p // page], p % page] = torch.randn(hkv, d, generator=g)
            vc[blocks[p // page], p % page] = torch.randn(hkv, d, generator=g)
        qs.append(torch.randn(new, hq, d, generator=g))
        ks.append(torch.randn(new, hkv, d, generator=g))
        vs.append(torch.randn(new, hkv, d, generator=g))
        slots += [blocks[p // page] * page + p % page for p in range(cached, total)]
        tables.append(blocks)
        lens.append(total)
        starts.append(starts[-1] + new)
    width = max([len(t) for t in tables] + [1])
    q = torch.cat(qs + [torch.randn(pad_tokens, hq, d, generator=g)])
    k = torch.cat(ks + [torch.randn(pad_tokens, hkv, d, generator=g)])
    v = torch.cat(vs + [torch.randn(pad_tokens, hkv, d, generator=g)])
    i64 = dict(dtype=torch.int64, device=device)
    return dict(
        q=q.to(device, dtype), k=k.to(device, dtype), v=v.to(device, dtype),
        k_cache=kc.to(device, dtype), v_cache=vc.to(device, dtype),
        slot_mapping=torch.tensor(slots + [-1] * pad_tokens, **i64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad_seqs,
                                  **i64).view(-1, width),
        seq_lens=torch.tensor(lens + [0] * pad_seqs, **i64),
        query_start_loc=torch.tensor(starts + [starts[-1]] * pad_seqs, **i64),
        scale=d ** -0.5)


def _reference_attention(args: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, k_cache, v_cache) of the torch reference, in float32 on the CPU."""
    ref = {name: (t.detach().cpu().float() if t.is_floating_point() else t.detach().cpu()).clone()
           if isinstance(t, torch.Tensor) else t for name, t in args.items()}
    out = paged_attention_ref(**ref)
    return out, ref["k_cache"], ref["v_cache"]


def _call_op(args: dict) -> torch.Tensor:
    """torch.ops.phaseflip.paged_attention with either signature: separate K/V caches, or the whole KV
    view [blocks, layers, 2, page, heads, D] and a layer index."""
    names = [a.name for a in torch.ops.phaseflip.paged_attention.default._schema.arguments]
    if "kv_cache" not in names:
        return torch.ops.phaseflip.paged_attention(**args)
    rest = {k: v for k, v in args.items() if k not in ("k_cache", "v_cache")}
    kv = torch.stack([args["k_cache"], args["v_cache"]], dim=1)[:, None]
    return torch.ops.phaseflip.paged_attention(kv_cache=kv, layer=0, **rest)


def _attention_check(seqs, group: int, d: int, page: int, *, entry: str = "op", num_splits=None,
                     dtype=torch.float32, pad=(0, 0), hkv: int = 2, tile_n: int = 32,
                     window: int = 0, softcap: float = 0.0) -> Callable[[str], float]:
    def check(device: str) -> float:
        from phaseflip.kernels.triton import attention as ta
        from phaseflip.kernels.triton.kv_store import store_kv_triton
        args = build_paged(seqs, group * hkv, hkv, d, page, pad_tokens=pad[0], pad_seqs=pad[1], dtype=dtype,
                           device=device, seed=len(seqs) * 131 + group * 7 + d + page)
        if window:
            args["window"] = window
        if softcap:
            args["softcap"] = softcap
        ref_out, _, _ = _reference_attention(args)
        if entry == "op":   # on CUDA through the custom op and its dispatch; the interpreter directly
            out = _call_op(args) if device.startswith("cuda") else ta.store_and_attend(**args)
        else:
            store_kv_triton(args["k"], args["v"], args["k_cache"], args["v_cache"], args["slot_mapping"])
            common = (args["q"], args["k_cache"], args["v_cache"], args["block_tables"], args["seq_lens"])
            if entry == "decode":
                out = ta.paged_decode_attention(*common, args["scale"], window=window, softcap=softcap,
                                                num_splits=num_splits, tile_n=tile_n)
            else:
                out = ta.paged_prefill_attention(*common, args["query_start_loc"], args["scale"], window=window,
                                                 softcap=softcap, num_splits=num_splits, tile_n=tile_n)
        return _compare(out, ref_out, dtype)
    return check


def _kv_store_check(page: int, num_tokens: int, pad_tokens: int, dtype=torch.float32) -> Callable[[str], float]:
    def check(device: str) -> float:
        from phaseflip.kernels.triton.kv_store import store_kv_triton
        g = torch.Generator().manual_seed(page + num_tokens)
        hkv, d, num_blocks = 3, 32, 6
        # a per-layer view of a [blocks, layers, 2, page, heads, dim] region: strided, like the engine's
        region = torch.randn(num_blocks, 2, 2, page, hkv, d, generator=g)
        slots = torch.randperm(num_blocks * page, generator=g)[:num_tokens].tolist() + [-1] * pad_tokens
        perm = torch.randperm(len(slots), generator=g).tolist()       # padding anywhere in the batch
        slot_mapping = torch.tensor([slots[i] for i in perm], dtype=torch.int64)
        k = torch.randn(len(slots), hkv, d, generator=g)
        v = torch.randn(len(slots), hkv, d, generator=g)
        ref_region = region.clone()
        store_kv(k, v, ref_region[:, 1, 0], ref_region[:, 1, 1], slot_mapping)
        dev_region = region.to(device, dtype)
        store_kv_triton(k.to(device, dtype), v.to(device, dtype), dev_region[:, 1, 0], dev_region[:, 1, 1],
                        slot_mapping.to(device))
        return _compare(dev_region, ref_region.to(dtype), dtype, exact=True)  # other layer untouched too
    return check


def _rms_norm_check(shape, dtype, fused: bool, scale: float = 1.0, strided: bool = False) -> Callable[[str], float]:
    def check(device: str) -> float:
        from phaseflip.kernels.triton.norm import add_rms_norm_triton, rms_norm_triton
        g = torch.Generator().manual_seed(sum(shape) + fused)
        h = shape[-1]
        x = torch.randn(*shape[:-1], 2 * h if strided else h, generator=g) * scale
        x = x[..., :h] if strided else x                               # q/k views of a fused qkv
        res = torch.randn(shape, generator=g) * scale
        w = torch.empty(h).uniform_(0.5, 1.5, generator=g)
        eps = 1e-6
        to = dict(device=device, dtype=dtype)
        if not fused:
            return _compare(rms_norm_triton(x.to(**to), w.to(**to), eps),
                            norm.rms_norm(x.to(dtype), w.to(dtype), eps), dtype)
        out, new_res = add_rms_norm_triton(x.to(**to), res.to(**to), w.to(**to), eps)
        ref_out, ref_res = norm.add_rms_norm(x.to(dtype), res.to(dtype), w.to(dtype), eps)
        _compare(new_res, ref_res, dtype)
        return _compare(out, ref_out, dtype)
    return check


def _rotary_check(num_tokens: int, heads: int, d: int, dtype, llama3: bool) -> Callable[[str], float]:
    def check(device: str) -> float:
        from phaseflip.kernels.triton.rotary import apply_rotary_triton
        g = torch.Generator().manual_seed(num_tokens * 31 + d + llama3)
        table = rotary.cos_sin_table(d, 256, 500000.0 if llama3 else 10000.0, Llama3Scaling() if llama3 else None)
        positions = torch.randint(0, 256, (num_tokens,), generator=g)
        x = torch.randn(num_tokens, heads + 1, d, generator=g)[:, 1:]          # strided, like q of qkv
        ref = rotary.apply_rotary(x.to(dtype), table[positions])
        got = apply_rotary_triton(x.to(device, dtype), table.to(device)[positions.to(device)])
        return _compare(got, ref, dtype)
    return check


def _silu_check(num_tokens: int, inter: int, dtype) -> Callable[[str], float]:
    def check(device: str) -> float:
        from phaseflip.kernels.triton.activation import silu_and_mul_triton
        g = torch.Generator().manual_seed(num_tokens + inter)
        x = torch.randn(num_tokens, 2 * inter, generator=g) * 3
        return _compare(silu_and_mul_triton(x.to(device, dtype)), activation.silu_and_mul(x.to(dtype)), dtype)
    return check


def _quant_check(type_id: int, rows: int, n: int, k: int, dtype) -> Callable[[str], float]:
    """The Triton product (and row lookup) on random blocks, through the ops the model calls on CUDA,
    against torch's decoding then a float32 product; the tolerance scales with the largest output."""
    def check(device: str) -> float:
        from phaseflip.kernels import dispatch  # noqa: F401  (defines phaseflip::quant_linear / quant_rows)
        blocks = quant_ref.random_blocks(type_id, n, k, seed=type_id + rows)
        w = quant_ref.dequantize(blocks, type_id)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        got = torch.ops.phaseflip.quant_linear(x.to(device), blocks.to(device), type_id).float().cpu()
        ref = x.float() @ w.t()
        atol, rtol = TOL[dtype]
        largest = float(ref.abs().max()) if ref.numel() else 0.0
        torch.testing.assert_close(got, ref, atol=atol * max(1.0, largest), rtol=rtol)
        ids = torch.tensor([n - 1, 0, n // 2, 0])
        rows_got = torch.ops.phaseflip.quant_rows(blocks.to(device), ids.to(device), type_id).cpu()
        torch.testing.assert_close(rows_got, w[ids], atol=0, rtol=0)
        return float((got - ref).abs().max()) if got.numel() else 0.0
    return check


def _moe_check(tokens: int, experts: int, top_k: int, dtype) -> Callable[[str], float]:
    """The grouped expert products through the op the model calls on CUDA, against the masked reference."""
    def check(device: str) -> float:
        from phaseflip.kernels import dispatch  # noqa: F401  (defines phaseflip::moe_experts)
        g = torch.Generator().manual_seed(tokens * experts + top_k)
        h = torch.randn(tokens, 96, generator=g).to(dtype)
        gate_up = (torch.randn(experts, 2 * 80, 96, generator=g) * 0.2).to(dtype)
        down = (torch.randn(experts, 96, 80, generator=g) * 0.2).to(dtype)
        logits = torch.randn(tokens, experts, generator=g) + torch.linspace(0, 4, experts)  # some experts idle
        weights, ids = moe_ref.route(logits, top_k, normalize=True)
        got = torch.ops.phaseflip.moe_experts(*(t.to(device) for t in (h, gate_up, down, ids, weights))).float().cpu()
        ref = moe_ref.experts(h, gate_up, down, ids, weights).float()
        atol, rtol = TOL[dtype]   # bfloat16: two products rounded on the way, so scaled to the largest output
        torch.testing.assert_close(got, ref, atol=atol * max(1.0, float(ref.abs().max())), rtol=rtol)
        return float((got - ref).abs().max())
    return check


def _cases() -> dict[str, Callable[[str], float]]:
    c: dict[str, Callable[[str], float]] = {}
    decode = [(0, 1), (16, 1), (39, 1), (70, 1)]        # contexts 1, 17, 40, 71: not multiples of a page
    for group in (1, 3, 4, 8):
        for d in (64, 128):
            for page in (16, 32):
                splits = 3 if (group + d // 64 + page // 16) % 2 else 1
                c[f"attention/decode-g{group}-d{d}-page{page}-splits{splits}"] = _attention_check(
                    decode, group, d, page, entry="decode", num_splits=splits, pad=(1, 1))
    mixed = [(10, 1), (0, 9), (6, 7), (37, 20), (0, 1)]  # decode, prompt, chunk over a prefix, one token
    for group, d, page, splits in ((1, 64, 16, 1), (4, 64, 32, 2), (3, 128, 16, 1), (8, 64, 16, 3)):
        c[f"attention/prefill-g{group}-d{d}-page{page}-splits{splits}"] = _attention_check(
            mixed, group, d, page, entry="prefill", num_splits=splits, pad=(3, 2))
    c["attention/op-mixed-bf16"] = _attention_check(mixed, 4, 64, 16, dtype=torch.bfloat16, pad=(2, 1))
    c["attention/op-decode-long-bf16"] = _attention_check([(600, 1), (5, 1)], 2, 64, 16,   # split by
                                                          dtype=torch.bfloat16, hkv=1)       # the heuristic
    for window, splits in ((20, 3), (1, 1)):   # a window inside the contexts, and a token seeing only itself
        c[f"attention/decode-window{window}-splits{splits}"] = _attention_check(
            decode, 2, 64, 16, entry="decode", num_splits=splits, pad=(1, 1), window=window)
        c[f"attention/prefill-window{window}-splits{splits}"] = _attention_check(
            mixed, 3, 64, 16, entry="prefill", num_splits=splits, pad=(2, 1), window=window)
    c["attention/op-window-bf16"] = _attention_check(mixed, 4, 64, 16, dtype=torch.bfloat16, pad=(2, 1), window=9)
    c["attention/decode-softcap-splits3"] = _attention_check(decode, 2, 64, 16, entry="decode", num_splits=3,
                                                             softcap=0.5)
    c["attention/op-window-softcap"] = _attention_check(mixed, 2, 64, 16, pad=(1, 1), window=8, softcap=0.5)
    c["attention/op-one-token"] = _attention_check([(0, 1)], 4, 64, 16)
    c["attention/op-all-padding"] = _attention_check([], 2, 64, 16, pad=(2, 2))
    c["attention/op-empty"] = _attention_check([], 2, 64, 16)
    for page in (16, 32):
        c[f"kv_store/page{page}"] = _kv_store_check(page, 37, 5)
    c["kv_store/bf16-one-token"] = _kv_store_check(16, 1, 0, torch.bfloat16)
    c["kv_store/padding-only"] = _kv_store_check(16, 0, 3)
    c["kv_store/empty"] = _kv_store_check(16, 0, 0)
    for dtype in (torch.float32, torch.bfloat16):
        tag = str(dtype).removeprefix("torch.")
        for fused in (False, True):
            name = "add_rms_norm" if fused else "rms_norm"
            c[f"{name}/{tag}-rows7-h100"] = _rms_norm_check((7, 100), dtype, fused)
            c[f"{name}/{tag}-one-row-small-values"] = _rms_norm_check((1, 64), dtype, fused, scale=1e-3)
            c[f"{name}/{tag}-empty"] = _rms_norm_check((0, 64), dtype, fused)
        c[f"rms_norm/{tag}-qk-heads-strided"] = _rms_norm_check((3, 4, 32), dtype, False, strided=True)
        for llama3 in (False, True):
            for d in (64, 128):
                c[f"rotary/{'llama3' if llama3 else 'default'}-{tag}-d{d}"] = _rotary_check(5, 3, d, dtype, llama3)
        c[f"rotary/{tag}-one-token-d16"] = _rotary_check(1, 2, 16, dtype, False)
        c[f"silu_and_mul/{tag}-5x100"] = _silu_check(5, 100, dtype)
        c[f"silu_and_mul/{tag}-one-token"] = _silu_check(1, 64, dtype)
    c["rotary/empty"] = _rotary_check(0, 2, 64, torch.float32, False)
    c["silu_and_mul/empty"] = _silu_check(0, 64, torch.float32)
    for name, type_id in QUANT_TYPES.items():
        c[f"quant/{name}-fp32-1-row"] = _quant_check(type_id, 1, 80, 512, torch.float32)
        c[f"quant/{name}-bf16-20-rows"] = _quant_check(type_id, 20, 70, 512, torch.bfloat16)
    c["quant/Q4_K-fp32-no-rows"] = _quant_check(12, 0, 16, 256, torch.float32)
    for tokens, experts, top_k, dtype in ((1, 8, 2, torch.float32), (5, 4, 1, torch.bfloat16),
                                          (70, 6, 2, torch.float32), (40, 8, 4, torch.bfloat16)):
        c[f"moe/{tokens}-tokens-{experts}-experts-top{top_k}-{str(dtype).removeprefix('torch.')}"] = \
            _moe_check(tokens, experts, top_k, dtype)
    return c


CASES = _cases()


def graph_replay_check(device: str, steps: int = 3) -> dict:
    """The attention op (store + attend) captured ONCE as a CUDA graph and replayed for `steps` decode
    steps whose metadata changes in place (new lengths, slots, queries): proves the launch sizes do not
    depend on values and nothing syncs with the host. On the CPU it runs uncaptured (wiring only)."""
    from phaseflip.kernels.triton.attention import store_and_attend
    page, captured = 16, device.startswith("cuda")
    static = build_paged([(60, 1), (40, 1), (17, 1), (0, 1)], 8, 2, 64, page, device=device, seed=5,
                         dtype=torch.bfloat16 if captured else torch.float32)
    ref = {k: (v.detach().cpu().float().clone() if isinstance(v, torch.Tensor) and v.is_floating_point()
               else v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in static.items()}
    replay = lambda: store_and_attend(**static)  # noqa: E731
    if captured:
        replay()   # warm-up outside the capture: Triton compiles here
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = store_and_attend(**static)
        replay = lambda: (graph.replay(), out)[1]  # noqa: E731
    g, errors = torch.Generator().manual_seed(6), []
    for step in range(steps):
        if step:   # the next decode step of every sequence, written into the same tensors
            pos = ref["seq_lens"].clone()
            blocks = ref["block_tables"][torch.arange(len(pos)), pos // page]
            new = dict(q=torch.randn(ref["q"].shape, generator=g), k=torch.randn(ref["k"].shape, generator=g),
                       v=torch.randn(ref["v"].shape, generator=g), slot_mapping=blocks * page + pos % page,
                       seq_lens=pos + 1)
            for name, t in new.items():
                ref[name].copy_(t)
                static[name].copy_(t)
        expected = paged_attention_ref(**ref)
        errors.append(_compare(replay(), expected, static["q"].dtype))
    return {"captured": captured, "replays": steps, "max_abs_err": max(errors)}


def run_cases(device: str, names=None) -> list[dict]:
    """Run `names` (default: every case) on `device`; one record per case, failures included."""
    results = []
    for name in names or CASES:
        try:
            results.append(dict(name=name, ok=True, max_abs_err=CASES[name](device)))
        except Exception as e:  # noqa: BLE001 — recorded, the next case still runs
            results.append(dict(name=name, ok=False, error=f"{type(e).__name__}: {e}"[:2000]))
    return results


def main(argv=None) -> int:
    """python -m phaseflip.kernels.selfcheck [--device cpu|cuda] [NAME ...]: prints the records as JSON.
    On the CPU, run it with TRITON_INTERPRET=1 in the environment (read when triton is imported)."""
    import argparse
    import json
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("names", nargs="*", help="cases to run (default: all)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}")
    results = run_cases(args.device, args.names or None)
    print(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
