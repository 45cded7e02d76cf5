"""paged_attention (the custom op, whose CPU body is kernels/cpu/attention.py) and the plain torch
reference, both against a naive per-token attention written independently."""
import math

import pytest
import torch

from phaseflip.kernels.attention import compiled_op
from phaseflip.kernels.cpu import attention as cpu_attention, library
from phaseflip.kernels.reference.attention import paged_attention_ref


def run_ref(kv_cache, layer, **args):
    return paged_attention_ref(k_cache=kv_cache[:, layer, 0], v_cache=kv_cache[:, layer, 1], **args)


def run_general(**args):
    """The op with the C++ decode kernel switched off: kernels/cpu/attention.py's gathers path alone."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(library, "decode_attention_op", lambda: None)
        return torch.ops.phaseflip.paged_attention(**args)


def run_cpp_op(**args):
    """What compiled CPU steps call (kernels/attention.py's compiled_op): phaseflip::cpu_paged_attention
    where it serves q's dtype and head size, else the op above."""
    if library.decode_attention_op() is None:
        pytest.skip(f"no C++ kernels here: {library.kernel_report()['reason']}")
    return compiled_op(args["q"])(**args)


# "op": what the engine runs eagerly (decode-only steps in the C++ kernel where it is built,
# kernels/cpu/library.py); "cpp_op": what its compiled CPU steps run
IMPLS = {"op": lambda **a: torch.ops.phaseflip.paged_attention(**a), "cpp_op": run_cpp_op,
         "general": run_general, "ref": run_ref}


def naive(q, keys, values, scale):
    # q: [Hq, D]; keys/values: [L, Hkv, D] -> [Hq, D]
    g = q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(g, dim=1)
    v = values.repeat_interleave(g, dim=1)
    s = torch.einsum("hd,lhd->hl", q, k) * scale
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


def _served_op_or_skip(head_dim: int):
    op = library.paged_attention_op(torch.float32, head_dim)
    if op is None:
        pytest.skip(f"cpu_paged_attention does not serve D = {head_dim} here: {library.kernel_report()}")
    return op


@pytest.mark.parametrize("seqs", STEPS)
@pytest.mark.parametrize("pad", [(0, 0), (3, 2)])
def test_the_cpp_op_matches_naive_at_a_head_size_it_serves(seqs, pad):
    """phaseflip::cpu_paged_attention itself (test_matches_naive's D = 8 is one it never serves)."""
    op = _served_op_or_skip(32)
    args, hist = build(seqs, pad_tokens=pad[0], pad_seqs=pad[1], num_blocks=120, d=32)
    assert compiled_op(args["q"]) is op
    check(op(**args), args, seqs, hist, tol=1e-4)


def test_compiled_steps_take_the_cpp_op_only_where_it_serves_every_step():
    """Chosen at trace time on q's dtype and head size; any other head size is an error in the op."""
    op = _served_op_or_skip(32)
    multiple = library.kernel_report()["head_multiple"]
    general = torch.ops.phaseflip.paged_attention
    assert compiled_op(torch.zeros(1, 4, 4 * multiple)) is op
    assert compiled_op(torch.zeros(1, 4, multiple + 8)) is general
    assert compiled_op(torch.zeros(1, 4, multiple, dtype=torch.half)) is general
    args, _ = build([(5, 1)], num_blocks=20, d=multiple + 8)
    with pytest.raises(RuntimeError, match=f"head size {multiple + 8} is not a multiple of {multiple}"):
        op(**args)


def check(out, args, seqs, hist, tol=1e-5):
    t = 0
    for (cached, new), (kh, vh, _) in zip(seqs, hist):
        for i in range(new):
            ctx = cached + i + 1
            ref = naive(args["q"][t], kh[:ctx], vh[:ctx], args["scale"])
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


def test_ragged_decodes_are_grouped_by_length():
    args, _ = build([(n, 1) for n in (2, 90, 7, 40, 3, 60, 11, 25)], num_blocks=120)
    plan = cpu_attention.build_gathers(args["slot_mapping"], args["block_tables"], args["seq_lens"],
                                    args["query_start_loc"], block_size=4, hkv=2, group=2)
    assert 1 < len(plan.decode) <= cpu_attention.MAX_GROUPS
    assert sorted(t for g in plan.decode for t in g.tokens.tolist()) == list(range(8))


@pytest.mark.parametrize("impl", ["op", "general"])
def test_a_reused_buffer_with_new_contents_gets_a_new_plan(impl):
    """The plan is remembered by value: refilling the same metadata tensors must not replay the old plan
    (the general path's plan; the C++ kernel, "op" here, reads the metadata anew every call)."""
    first, _ = build([(5, 1), (17, 1)], seed=1)
    IMPLS[impl](**first)
    second, hist = build([(9, 1), (18, 1)], seed=2)
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        first[name].copy_(second[name])  # same tensors, same shapes, new contents
    second.update({name: first[name] for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")})
    out = IMPLS[impl](**second)
    check(out, second, [(9, 1), (18, 1)], hist)


def _kernel_or_skip():
    op = library.decode_attention_op()
    if op is None:
        pytest.skip(f"no C++ decode kernel here: {library.kernel_report()['reason']}")
    return op


@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (16, 2, 32), (9, 1, 48), (4, 4, 24)])
def test_decodes_at_model_head_sizes_match_naive(hq, hkv, d):
    """Head sizes a multiple of 16 take the kernel's vector path (groups of up to 8 query heads);
    the others (a group of 9, D = 24) its plain loops."""
    seqs = [(n, 1) for n in (2, 90, 7, 40, 300)]
    args, hist = build(seqs, num_blocks=160, pad_tokens=1, pad_seqs=1, hq=hq, hkv=hkv, d=d, block_size=16)
    check(IMPLS["op"](**args), args, seqs, hist)


def test_decodes_with_scores_past_exp_range_match_naive():
    """Scores in the hundreds (e^100 overflows float32): each row's softmax must subtract its true max,
    which the kernel finds eight or sixteen lanes at a time."""
    seqs = [(n, 1) for n in (2, 90, 7, 40)]
    args, hist = build(seqs, num_blocks=120, hq=9, hkv=3, d=64, block_size=16)
    args["q"] = args["q"] * 200
    out = IMPLS["op"](**args)
    assert torch.isfinite(out).all()
    check(out, args, seqs, hist, tol=1e-3)   # the scores' own rounding, magnified 200x


@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (16, 2, 32), (8, 8, 128), (4, 1, 16)])
@pytest.mark.parametrize("seqs", [
    [(0, 128)],                            # a whole prompt: 8 blocks of query tokens, causal
    [(37, 50)],                            # a chunk over a cached prefix, neither a whole number of blocks
    [(300, 17)],                           # a short chunk over a long prefix
    [(10, 1), (0, 40), (8, 1), (4, 33)],   # chunks and decodes in one step
    [(0, 2), (5, 3)],                      # chunks shorter than a row group
])
def test_prompt_chunks_at_model_head_sizes_match_naive(hq, hkv, d, seqs):
    """Head sizes a multiple of two vectors take the kernel's chunk tiles (kernels/cpu/prefill.cpp)
    where it is built; the kernel writes every row itself (the general path is switched off)."""
    args, hist = build(seqs, num_blocks=200, pad_tokens=2, pad_seqs=1, hq=hq, hkv=hkv, d=d, block_size=16)
    served = library.decode_attention_op() is not None and d % 32 == 0   # 16 or 32 lanes x 2
    with pytest.MonkeyPatch.context() as mp:
        if served:
            mp.setattr(cpu_attention, "_gathers", None)   # any use of the general path would raise
        check(IMPLS["op"](**args), args, seqs, hist, tol=1e-4)


def test_prompt_chunks_with_scores_past_exp_range_match_naive():
    seqs = [(0, 40), (20, 30)]
    args, hist = build(seqs, num_blocks=120, hq=9, hkv=3, d=64, block_size=16)
    args["q"] = args["q"] * 200
    out = IMPLS["op"](**args)
    assert torch.isfinite(out).all()
    check(out, args, seqs, hist, tol=1e-3)


def test_the_kernel_declines_a_prompt_chunk_at_a_head_size_its_tiles_do_not_divide():
    """It returns nothing and writes nothing (the caller's general path runs the step)."""
    op = _kernel_or_skip()
    args, _ = build([(5, 1), (0, 3)], num_blocks=20, d=24)
    before = args["kv_cache"].clone()
    out = op(args["q"], args["k"], args["v"], args["kv_cache"][:, 0], args["slot_mapping"], args["block_tables"],
             args["seq_lens"], args["query_start_loc"], args["scale"])
    assert out.numel() == 0 and torch.equal(args["kv_cache"], before)


def test_the_kernel_refuses_a_chunk_longer_than_its_context():
    op = _kernel_or_skip()
    args, _ = build([(0, 5)], num_blocks=20, hq=9, hkv=3, d=64, block_size=16)
    args["seq_lens"][0] = 4
    with pytest.raises(RuntimeError, match="sequence 0 brings 5 tokens .from 0. to a context of 4"):
        op(args["q"], args["k"], args["v"], args["kv_cache"][:, 0], args["slot_mapping"], args["block_tables"],
           args["seq_lens"], args["query_start_loc"], args["scale"])


def test_the_kernel_names_the_dtypes_it_takes():
    op = _kernel_or_skip()
    args, _ = build([(5, 1)], num_blocks=20)
    half = {k: v.half() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in args.items()}
    with pytest.raises(RuntimeError, match="decode_attention: float32 or bfloat16, got Half"):
        op(half["q"], half["k"], half["v"], half["kv_cache"][:, 0], half["slot_mapping"], half["block_tables"],
           half["seq_lens"], half["query_start_loc"], half["scale"])


def test_the_decode_kernel_refuses_a_block_id_outside_the_cache():
    op = _kernel_or_skip()
    args, _ = build([(5, 1)], num_blocks=20)
    args["block_tables"][0, 0] = 99
    with pytest.raises(RuntimeError, match="block id 99 outside 0..19"):
        op(args["q"], args["k"], args["v"], args["kv_cache"][:, 0], args["slot_mapping"], args["block_tables"],
           args["seq_lens"], args["query_start_loc"], args["scale"])


@pytest.mark.parametrize("seqs", [[(n, 1) for n in (2, 90, 7, 40)], [(0, 70), (9, 1), (33, 20)]])
def test_bf16_steps_agree_with_the_general_path(seqs):
    """bfloat16 caches: the kernel (float32 sums, read in place) against the gathers path's SDPA."""
    _kernel_or_skip()
    args, _ = build(seqs, num_blocks=120, pad_tokens=1, pad_seqs=1, hq=9, hkv=3, d=64, block_size=16)
    args = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in args.items()}
    general = {**args, "kv_cache": args["kv_cache"].clone()}
    out = IMPLS["op"](**args)
    torch.testing.assert_close(out, run_general(**general), atol=2e-2, rtol=2e-2)
    assert torch.equal(args["kv_cache"], general["kv_cache"]), "the two stored different K/V"
