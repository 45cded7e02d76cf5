"""paged_attention (the custom op: on the CPU the C++ kernels' phaseflip::cpu_paged_attention) and the
plain torch reference, both against a naive per-token attention written independently."""
import math

import pytest
import torch

from phaseflip.kernels.attention import compiled_op
from phaseflip.kernels.cpu import library
from phaseflip.kernels.reference.attention import paged_attention_ref


def run_ref(kv_cache, layer, **args):
    return paged_attention_ref(k_cache=kv_cache[:, layer, 0], v_cache=kv_cache[:, layer, 1], **args)


def cpp_or_skip(dtype=torch.float32):
    op = library.paged_attention_op(dtype)
    if op is None:
        pytest.skip(f"no C++ kernels here: {library.kernel_report()['reason']}")
    return op


def run_cpp_op(**args):
    """phaseflip::cpu_paged_attention itself: what the op runs on the CPU and compiled CPU steps call."""
    return cpp_or_skip(args["q"].dtype)(**args)


# "op": what the engine's model calls (kernels/attention.py); "cpp_op": the C++ kernels' op alone
IMPLS = {"op": lambda **a: torch.ops.phaseflip.paged_attention(**a), "cpp_op": run_cpp_op, "ref": run_ref}


def naive(q, keys, values, scale, softcap=0.0):
    # q: [Hq, D]; keys/values: [L, Hkv, D] -> [Hq, D]
    g = q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(g, dim=1)
    v = values.repeat_interleave(g, dim=1)
    s = torch.einsum("hd,lhd->hl", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return torch.einsum("hl,lhd->hd", s.softmax(-1), v)


def block_major(num_blocks, layers, block_size, hkv, d, spare=0):
    """A KV region as the engine lays it out: [blocks, layers, 2, block_size, hkv, d], each block
    `spare` elements longer than it needs (the padding a rank's larger view leaves in the smaller)."""
    block = layers * 2 * block_size * hkv * d
    region = torch.zeros(num_blocks * (block + spare))
    inner = (2 * block_size * hkv * d, block_size * hkv * d, hkv * d, d, 1)
    return region.as_strided((num_blocks, layers, 2, block_size, hkv, d), (block + spare, *inner))


def build(seqs, hq=4, hkv=2, d=8, block_size=4, num_blocks=40, pad_tokens=0, pad_seqs=0, seed=0, layers=1,
          spare=0):
    """seqs: list of (cached_len, new_len). Returns op args (for the last layer of a block-major region)
    plus the full K/V history per sequence."""
    g = torch.Generator().manual_seed(seed)
    kv = block_major(num_blocks, layers, block_size, hkv, d, spare)
    kc, vc = kv[:, layers - 1, 0], kv[:, layers - 1, 1]
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
        q=q, k=k, v=v, kv_cache=kv, layer=layers - 1,
        slot_mapping=torch.tensor(slots + [-1] * pad_tokens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad_seqs),
        seq_lens=torch.tensor(lens + [0] * pad_seqs),
        query_start_loc=torch.tensor(starts + [0] * pad_seqs),
        scale=d ** -0.5)
    return args, hist


STEPS = [
    [(0, 1)],                              # a one-token prompt
    [(5, 1), (17, 1), (3, 1)],             # decodes only, ragged contexts
    [(0, 9)],                              # a prompt chunk without prefix
    [(6, 7)],                              # a chunk over a cached prefix, crossing blocks
    [(10, 1), (0, 5), (8, 1), (4, 6)],     # mixed batch
    [(n, 1) for n in (2, 90, 7, 40, 3, 60, 11, 25)],  # ragged decodes: several length groups
]


@pytest.mark.parametrize("seqs", STEPS)
@pytest.mark.parametrize("pad", [(0, 0), (3, 2)])
@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_matches_naive(seqs, pad, impl):
    args, hist = build(seqs, pad_tokens=pad[0], pad_seqs=pad[1], num_blocks=120)
    out = IMPLS[impl](**args)
    check(out, args, seqs, hist)


def test_compiled_steps_take_the_cpp_op_for_the_dtypes_it_is_built_for():
    """Chosen at trace time on q's dtype alone: every head size and step of float32 and bfloat16."""
    op = cpp_or_skip()
    general = torch.ops.phaseflip.paged_attention
    for d in (8, 24, 48, 64, 80, 128):
        assert compiled_op(torch.zeros(1, 4, d)) is op
        assert compiled_op(torch.zeros(1, 4, d, dtype=torch.bfloat16)) is op
    assert compiled_op(torch.zeros(1, 4, 64, dtype=torch.half)) is general


def test_float16_on_the_cpu_runs_the_reference():
    """The C++ kernels are written for float32 and bfloat16; a float16 step still attends correctly."""
    seqs = [(10, 1), (0, 5), (4, 6)]
    args, hist = build(seqs, num_blocks=40)
    half = {k: v.half() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in args.items()}
    out = torch.ops.phaseflip.paged_attention(**half)
    assert out.dtype == torch.half
    check(out.float(), args, seqs, hist, tol=1e-2)


def check(out, args, seqs, hist, tol=1e-5):
    """Each real token against naive attention over its positions (with args["window"] W: the last W of
    them, transformers' sliding mask); padding tokens zero."""
    t, window = 0, args.get("window", 0)
    for (cached, new), (kh, vh, _) in zip(seqs, hist):
        for i in range(new):
            ctx = cached + i + 1
            first = max(0, ctx - window) if window else 0
            ref = naive(args["q"][t], kh[first:ctx], vh[first:ctx], args["scale"], args.get("softcap", 0.0))
            torch.testing.assert_close(out[t], ref, atol=tol, rtol=tol)
            t += 1
    assert torch.all(out[t:] == 0), "padding tokens must produce zeros"


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_a_layer_of_a_padded_block_major_region(impl):
    """The engine's region: several layers per block and blocks a padded stride apart."""
    seqs = [(10, 1), (0, 5), (8, 1), (4, 6)]
    args, hist = build(seqs, pad_tokens=2, layers=3, spare=24, num_blocks=30)
    other = args["kv_cache"][:, 0].clone()
    check(IMPLS[impl](**args), args, seqs, hist)
    assert torch.equal(args["kv_cache"][:, 0], other), "another layer's KV was written"


def test_store_writes_exactly_the_slots():
    args, hist = build([(3, 2), (0, 3)], pad_tokens=2)
    k_cache = args["kv_cache"][:, 0, 0]
    before_k = k_cache.clone()
    torch.ops.phaseflip.paged_attention(**args)
    flat = k_cache.reshape(-1, *k_cache.shape[2:])
    slots = args["slot_mapping"]
    real = slots[slots >= 0]
    torch.testing.assert_close(flat[real], args["k"][: len(real)])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[real] = False
    assert torch.equal(flat[untouched], before_k.view(-1, *before_k.shape[2:])[untouched])


def test_a_reused_buffer_with_new_contents_is_read_anew():
    """The metadata's values are read every call: refilling the same tensors must not replay a step."""
    first, _ = build([(5, 1), (17, 1)], seed=1)
    IMPLS["op"](**first)
    second, hist = build([(9, 1), (18, 1)], seed=2)
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        first[name].copy_(second[name])  # same tensors, same shapes, new contents
    second.update({name: first[name] for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")})
    out = IMPLS["op"](**second)
    check(out, second, [(9, 1), (18, 1)], hist)


@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (16, 2, 32), (9, 1, 48), (4, 4, 24)])
def test_decodes_at_model_head_sizes_match_naive(hq, hkv, d):
    """Head sizes a multiple of 16 take the kernel's vector path (groups of up to 8 query heads);
    the others (a group of 9, D = 24) its plain loops."""
    seqs = [(n, 1) for n in (2, 90, 7, 40, 300)]
    args, hist = build(seqs, num_blocks=160, pad_tokens=1, pad_seqs=1, hq=hq, hkv=hkv, d=d, block_size=16)
    check(IMPLS["cpp_op"](**args), args, seqs, hist)


@pytest.mark.parametrize("window", [1, 5, 16, 33, 1000])
@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (4, 4, 24)])   # the vector path, the plain loops
@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_sliding_windows_match_naive(impl, hq, hkv, d, window):
    """A window inside a block, across blocks, longer than every context: decodes read from the window's
    oldest position (mid-block), prompt chunks weigh the positions before each row's window 0."""
    seqs = [(2, 1), (90, 1), (40, 1), (0, 40), (37, 50), (300, 17)]
    args, hist = build(seqs, num_blocks=200, pad_tokens=2, pad_seqs=1, hq=hq, hkv=hkv, d=d, block_size=16)
    args["window"] = window
    check(IMPLS[impl](**args), args, seqs, hist, tol=1e-4)


@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_soft_capped_scores_match_naive(impl, window):
    """Gemma 2's cap: scores (large here) taken as softcap * tanh(s / softcap) before the softmax."""
    seqs = [(2, 1), (90, 1), (0, 40), (37, 50)]
    args, hist = build(seqs, num_blocks=120, pad_tokens=1, pad_seqs=1, hq=9, hkv=3, d=64, block_size=16)
    args.update(q=args["q"] * 8, softcap=5.0, window=window)
    check(IMPLS[impl](**args), args, seqs, hist, tol=1e-4)


def test_decodes_with_scores_past_exp_range_match_naive():
    """Scores in the hundreds (e^100 overflows float32): each row's softmax must subtract its true max,
    which the kernel finds eight or sixteen lanes at a time."""
    seqs = [(n, 1) for n in (2, 90, 7, 40)]
    args, hist = build(seqs, num_blocks=120, hq=9, hkv=3, d=64, block_size=16)
    args["q"] = args["q"] * 200
    out = IMPLS["cpp_op"](**args)
    assert torch.isfinite(out).all()
    check(out, args, seqs, hist, tol=1e-3)   # the scores' own rounding, magnified 200x


@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (16, 2, 32), (8, 8, 128), (4, 1, 16), (9, 1, 48), (4, 2, 80),
                                       (4, 4, 24), (2, 1, 8)])
@pytest.mark.parametrize("seqs", [
    [(0, 128)],                            # a whole prompt: 8 blocks of query tokens, causal
    [(37, 50)],                            # a chunk over a cached prefix, neither a whole number of blocks
    [(300, 17)],                           # a short chunk over a long prefix
    [(10, 1), (0, 40), (8, 1), (4, 33)],   # chunks and decodes in one step
    [(0, 2), (5, 3)],                      # chunks shorter than a row group
])
def test_prompt_chunks_at_model_head_sizes_match_naive(hq, hkv, d, seqs):
    """The kernel's chunk tiles (kernels/cpu/prefill.cpp) at every head size: those that are not a
    multiple of the tiles' columns (48, 80, 24, 8) run in the same tiles over V padded with zeros."""
    args, hist = build(seqs, num_blocks=200, pad_tokens=2, pad_seqs=1, hq=hq, hkv=hkv, d=d, block_size=16)
    check(IMPLS["cpp_op"](**args), args, seqs, hist, tol=1e-4)


def test_prompt_chunks_with_scores_past_exp_range_match_naive():
    seqs = [(0, 40), (20, 30)]
    args, hist = build(seqs, num_blocks=120, hq=9, hkv=3, d=64, block_size=16)
    args["q"] = args["q"] * 200
    out = IMPLS["cpp_op"](**args)
    assert torch.isfinite(out).all()
    check(out, args, seqs, hist, tol=1e-3)


def test_the_kernel_refuses_a_chunk_longer_than_its_context():
    op = cpp_or_skip()
    args, _ = build([(0, 5)], num_blocks=20, hq=9, hkv=3, d=64, block_size=16)
    args["seq_lens"][0] = 4
    with pytest.raises(RuntimeError, match="sequence 0 brings 5 tokens .from 0. to a context of 4"):
        op(**args)


def test_the_kernel_names_the_dtypes_it_takes():
    op = cpp_or_skip()
    args, _ = build([(5, 1)], num_blocks=20)
    half = {k: v.half() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in args.items()}
    with pytest.raises(RuntimeError, match="cpu_paged_attention: float32 or bfloat16, got Half"):
        op(**half)


def test_the_decode_kernel_refuses_a_block_id_outside_the_cache():
    op = cpp_or_skip()
    args, _ = build([(5, 1)], num_blocks=20)
    args["block_tables"][0, 0] = 99
    with pytest.raises(RuntimeError, match="block id 99 outside 0..19"):
        op(**args)


@pytest.mark.parametrize("seqs", [[(n, 1) for n in (2, 90, 7, 40)], [(0, 70), (9, 1), (33, 20)]])
@pytest.mark.parametrize("d", [64, 48])
def test_bf16_steps_match_naive_on_the_same_values(seqs, d):
    """bfloat16 caches: the kernel (float32 sums, read in place) against the naive attention of the
    bfloat16 values, within bfloat16's rounding of the output."""
    cpp_or_skip(torch.bfloat16)
    args, hist = build(seqs, num_blocks=120, pad_tokens=1, pad_seqs=1, hq=9, hkv=3, d=d, block_size=16)
    bf = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
          for k, v in args.items()}
    rounded = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in bf.items()}
    hist = [(kh.bfloat16().float(), vh.bfloat16().float(), c) for kh, vh, c in hist]
    out = IMPLS["cpp_op"](**bf)
    check(out.float(), rounded, seqs, hist, tol=2e-2)


_PLAIN_CHILD = """
import sys, torch
torch.ops.load_library(sys.argv[1])
steps = torch.load(sys.argv[2])
torch.save([torch.ops.phaseflip.cpu_paged_attention(**args) for args in steps], sys.argv[3])
"""


@pytest.mark.slow   # two C++ builds of its own, ~55 s on 2 cores
def test_a_build_without_vectors_attends_every_step(tmp_path):
    """A CPU with neither AVX2 nor AVX-512: decode.cpp and prefill.cpp built for plain x86-64 (no
    PF_LANES) serve decodes and prompt chunks in plain loops; loaded in a child process (its ops share
    the names of the kernels this process has loaded)."""
    import subprocess
    import sys
    from torch.utils.cpp_extension import include_paths, library_paths
    if library.paged_attention_op(torch.float32) is None:
        pytest.skip(f"no C++ compiler or kernels here: {library.kernel_report()['reason']}")
    so = tmp_path / "plain.so"
    sources = [str(src) for src in library.SOURCES if src.name in ("decode.cpp", "prefill.cpp")]
    flags = [f for f in library._flags() if f not in ("-O3", "-march=native")]
    subprocess.run(["g++", "-O1", "-march=x86-64", *flags, *(f"-I{p}" for p in include_paths()), *sources,
                    "-o", str(so), *(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu", "-lgomp"],
                   check=True, capture_output=True)
    cases = [([(10, 1), (0, 40), (8, 1), (4, 33)], dict(hq=9, hkv=3, d=64)),
             ([(37, 50), (5, 1)], dict(hq=4, hkv=2, d=24)), ([(0, 9), (6, 7)], dict(hq=4, hkv=2, d=8))]
    built = [build(seqs, num_blocks=200, pad_tokens=2, pad_seqs=1, block_size=16, **heads) for seqs, heads in cases]
    torch.save([args for args, _ in built], tmp_path / "steps.pt")
    subprocess.run([sys.executable, "-c", _PLAIN_CHILD, str(so), str(tmp_path / "steps.pt"), str(tmp_path / "out.pt")],
                   check=True, capture_output=True)
    for out, (seqs, _), (args, hist) in zip(torch.load(tmp_path / "out.pt"), cases, built):
        check(out, args, seqs, hist, tol=1e-4)
