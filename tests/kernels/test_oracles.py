"""The torch references that judge every kernel (kernels/selfcheck.py's oracles for Triton, the C++
kernels' tests, the CPU fallbacks) against naive float64 loops written from the formulas, on the very
inputs the kernel cases use: a wrong oracle would otherwise pass a kernel that shares its mistake.

Written from the math, not from the engine: attention is softmax(q k^T * scale) v over each sequence's
cached positions (read page by page through its block table) and its new ones, causal, a query head
reading kv head h // group; RMSNorm is x / sqrt(mean(x^2) + eps) * w; rotary is HF's rotate_half form
with inverse frequencies theta^(-2i/d) (llama3: Meta's wavelength bands); SiLU-and-mul is
gate / (1 + exp(-gate)) * up.
"""
import math

import pytest
import torch

from phaseflip.kernels.reference import activation, norm, rotary
from phaseflip.kernels.reference.attention import paged_attention_ref
from phaseflip.kernels.selfcheck import Llama3Scaling, build_paged

F64 = torch.float64


def naive_attention(a: dict) -> tuple[torch.Tensor, list[int]]:
    """(out [T, Hq, D] float64, the rows of real tokens): one query at a time, one key at a time."""
    q, k, v = a["q"].to(F64), a["k"].to(F64), a["v"].to(F64)
    kc, vc, page = a["k_cache"].to(F64), a["v_cache"].to(F64), a["k_cache"].shape[1]
    hq, hkv = q.shape[1], k.shape[1]
    starts, lens = a["query_start_loc"].tolist(), a["seq_lens"].tolist()
    out, rows = torch.zeros_like(q), []
    for i, seq_len in enumerate(lens):
        first, last = starts[i], starts[i + 1]
        if seq_len == 0:
            continue
        cached = seq_len - (last - first)
        table = a["block_tables"][i].tolist()
        keys = [kc[table[p // page], p % page] for p in range(cached)] + [k[t] for t in range(first, last)]
        values = [vc[table[p // page], p % page] for p in range(cached)] + [v[t] for t in range(first, last)]
        for t in range(first, last):
            rows.append(t)
            visible = cached + (t - first) + 1
            for h in range(hq):
                kv_head = h // (hq // hkv)
                scores = [float(q[t, h] @ keys[p][kv_head]) * a["scale"] for p in range(visible)]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                out[t, h] = sum(w / total * values[p][kv_head] for p, w in enumerate(weights))
    return out, rows


@pytest.mark.parametrize("seqs,group,d,page", [
    ([(0, 1), (16, 1), (39, 1)], 4, 64, 16),                  # decodes, contexts across pages
    ([(10, 1), (0, 9), (6, 7), (37, 20), (0, 1)], 3, 32, 16),  # decode, prompt, chunks over a prefix
    ([(5, 3)], 1, 16, 32),
])
def test_paged_attention_reference_is_attention(seqs, group, d, page):
    args = build_paged(seqs, group * 2, 2, d, page, pad_tokens=2, pad_seqs=1, seed=7)
    want, rows = naive_attention({n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in args.items()})
    got = paged_attention_ref(**args)
    torch.testing.assert_close(got[rows].to(F64), want[rows], atol=1e-5, rtol=1e-5)
    # and it stored every real token's K/V at its slot
    for t, slot in enumerate(args["slot_mapping"].tolist()):
        if slot >= 0:
            assert torch.equal(args["k_cache"][slot // page, slot % page], args["k"][t])
            assert torch.equal(args["v_cache"][slot // page, slot % page], args["v"][t])


def test_rms_norm_references_are_rms_norm():
    g = torch.Generator().manual_seed(0)
    x, res, w = torch.randn(5, 48, generator=g) * 3, torch.randn(5, 48, generator=g), torch.rand(48, generator=g)
    eps = 1e-6
    want = torch.stack([row.to(F64) / math.sqrt(float((row.to(F64) ** 2).mean()) + eps) for row in x]) * w.to(F64)
    torch.testing.assert_close(norm.rms_norm(x, w, eps).to(F64), want, atol=1e-6, rtol=1e-5)
    summed = x.to(F64) + res.to(F64)
    want_fused = torch.stack([r / math.sqrt(float((r ** 2).mean()) + eps) for r in summed]) * w.to(F64)
    out, new_res = norm.add_rms_norm(x, res, w, eps)
    torch.testing.assert_close(new_res.to(F64), summed, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.to(F64), want_fused, atol=1e-6, rtol=1e-5)


def naive_inv_freq(d: int, theta: float, llama3: Llama3Scaling | None) -> list[float]:
    freqs = [theta ** (-2 * i / d) for i in range(d // 2)]
    if llama3 is None:
        return freqs
    old = llama3.original_max_position_embeddings
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / llama3.high_freq_factor:
            out.append(f)                          # short wavelengths: kept
        elif wavelen > old / llama3.low_freq_factor:
            out.append(f / llama3.factor)          # long: slowed by the factor
        else:                                      # between: blended
            smooth = (old / wavelen - llama3.low_freq_factor) / (llama3.high_freq_factor - llama3.low_freq_factor)
            out.append((1 - smooth) * f / llama3.factor + smooth * f)
    return out


@pytest.mark.parametrize("llama3", [None, Llama3Scaling()], ids=["default", "llama3"])
@pytest.mark.parametrize("d", [16, 64])
def test_rotary_reference_is_rotate_half(d, llama3):
    theta = 500000.0 if llama3 else 10000.0
    g = torch.Generator().manual_seed(d)
    positions = [0, 1, 7, 63, 200]
    x = torch.randn(len(positions), 3, d, generator=g)
    got = rotary.apply_rotary(x, rotary.cos_sin_table(d, 256, theta, llama3)[torch.tensor(positions)])
    inv, half = naive_inv_freq(d, theta, llama3), d // 2
    want = torch.empty(x.shape, dtype=F64)
    for t, pos in enumerate(positions):
        for j in range(d):
            angle = pos * inv[j % half]
            partner = -x[t, :, j + half] if j < half else x[t, :, j - half]   # rotate_half
            want[t, :, j] = x[t, :, j].to(F64) * math.cos(angle) + partner.to(F64) * math.sin(angle)
    torch.testing.assert_close(got.to(F64), want, atol=2e-4, rtol=1e-4)   # float32 angles up to 200 rad


def test_silu_and_mul_reference_is_silu_times_up():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 2 * 40, generator=g) * 3
    gate, up = x[:, :40].to(F64), x[:, 40:].to(F64)
    want = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(activation.silu_and_mul(x).to(F64), want, atol=1e-5, rtol=1e-5)
