"""paged_attention (the custom op) against a naive per-token attention written independently."""
import math

import pytest
import torch

from phaseflip.kernels.attention import paged_attention_ref  # noqa: F401 (registers the op)


def naive(q, keys, values, scale):
    # q: [Hq, D]; keys/values: [L, Hkv, D] -> [Hq, D]
    g = q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(g, dim=1)
    v = values.repeat_interleave(g, dim=1)
    s = torch.einsum("hd,lhd->hl", q, k) * scale
    return torch.einsum("hl,lhd->hd", s.softmax(-1), v)


def build(seqs, hq=4, hkv=2, d=8, block_size=4, num_blocks=40, pad_tokens=0, pad_seqs=0, seed=0):
    """seqs: list of (cached_len, new_len). Returns op args plus the full K/V history per sequence."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.zeros(2, 1, num_blocks, block_size, hkv, d)   # one layer's K and V, as the op takes them
    kc, vc = kv[0, 0], kv[1, 0]
    free = list(torch.randperm(num_blocks, generator=g).tolist())
    tables, hist, qs, ks, vs, slots, lens, starts = [], [], [], [], [], [], [], [0]
    for cached, new in seqs:
        total = cached + new
        blocks = [free.pop() for _ in range(math.ceil(total / block_size))]
        kh, vh = torch.randn(total, hkv, d, generator=g), torch.randn(total, hkv, d, generator=g)
        for p in range(cached):  # history already in the cache
            kc[blocks[p // block_size], p % block_size] = kh[p]
            vc[blocks[p // block_size], p % block_size] = vh[p]
        qs.append(torch.randn(new, hq, d, generator=g))
        ks.append(kh[cached:])
        vs.append(vh[cached:])
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(cached, total)]
        tables.append(blocks)
        hist.append((kh, vh, cached))
        lens.append(total)
        starts.append(starts[-1] + new)
    width = max(len(t) for t in tables)
    q = torch.cat(qs + [torch.randn(pad_tokens, hq, d, generator=g)])
    k = torch.cat(ks + [torch.randn(pad_tokens, hkv, d, generator=g)])
    v = torch.cat(vs + [torch.randn(pad_tokens, hkv, d, generator=g)])
    args = dict(
        q=q, k=k, v=v, kv_cache=kv, layer=0,
        slot_mapping=torch.tensor(slots + [-1] * pad_tokens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad_seqs),
        seq_lens=torch.tensor(lens + [0] * pad_seqs),
        query_start_loc=torch.tensor(starts + [0] * pad_seqs),
        scale=d ** -0.5)
    return args, hist


@pytest.mark.parametrize("seqs", [
    [(0, 1)],                              # a one-token prompt
    [(5, 1), (17, 1), (3, 1)],             # decodes only, ragged contexts
    [(0, 9)],                              # a prompt chunk without prefix
    [(6, 7)],                              # a chunk over a cached prefix, crossing blocks
    [(10, 1), (0, 5), (8, 1), (4, 6)],     # mixed batch
])
@pytest.mark.parametrize("pad", [(0, 0), (3, 2)])
def test_matches_naive(seqs, pad):
    args, hist = build(seqs, pad_tokens=pad[0], pad_seqs=pad[1])
    out = torch.ops.phaseflip.paged_attention(**args)
    t = 0
    for (cached, new), (kh, vh, _) in zip(seqs, hist):
        for i in range(new):
            ctx = cached + i + 1
            ref = naive(args["q"][t], kh[:ctx], vh[:ctx], args["scale"])
            torch.testing.assert_close(out[t], ref, atol=1e-5, rtol=1e-5)
            t += 1
    assert torch.all(out[t:] == 0), "padding tokens must produce zeros"


def test_store_writes_exactly_the_slots():
    args, hist = build([(3, 2), (0, 3)], pad_tokens=2)
    k_cache = args["kv_cache"][0, 0]
    before_k = k_cache.clone()
    torch.ops.phaseflip.paged_attention(**args)
    flat = k_cache.view(-1, *k_cache.shape[2:])
    slots = args["slot_mapping"]
    real = slots[slots >= 0]
    torch.testing.assert_close(flat[real], args["k"][: len(real)])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[real] = False
    assert torch.equal(flat[untouched], before_k.view(-1, *before_k.shape[2:])[untouched])
