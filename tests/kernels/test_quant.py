"""kernels/cpu/quant.cpp: products on GGUF block-format weights against gguf's own decoder
(gguf.quants.dequantize) followed by F.linear of x as the kernel sees it (rounded to int8 per block
where it takes integer products, as it is where exact), over random blocks, 1-300 rows of x, float32 and
bfloat16 activations, both settings of the products (quant.set_int8_x); a format not served, and rows
that are not whole blocks, are refused by name. The few-rows
limit the boot sets (kernels/cpu/few_rows.h) moves rows between the two int8 forms, both giving the
product; forms.choose_block_rows measures it per format and sets it, or takes a recorded one."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf", reason="the gguf package (a dependency) is not installed")
from gguf import quants  # noqa: E402

from phaseflip.kernels.cpu import forms, quant  # noqa: E402


@pytest.fixture(scope="module")
def op(cpu_kernels):
    return cpu_kernels.quant_linear_op()


def _products(set_int8_x, products: str) -> None:
    """The process's products on blocks set to `products` ("int8" | "exact"); int8 skipped without the dots."""
    if products == "int8" and not quant.has_int8_dot():
        pytest.skip("this CPU's kernels have no integer dots (AVX2): products on blocks take x as it is")
    set_int8_x(products == "int8")


# where each format keeps its fp16 scales (gguf's Python quantizer writes no K-format block: theirs are
# random bytes with these set to finite scales)
SCALES_AT = {"Q4_K": (0, 2), "Q6_K": (208,)}


def _blocks(fmt: quant.BlockFormat, n: int, k: int, seed: int):
    """Random weights [n, k] as fmt's blocks (quantized by gguf itself where its quantizer writes fmt,
    else random bytes with finite scales): (the blocks as a uint8 tensor, gguf's decoding)."""
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[fmt.name]
    if fmt.name in SCALES_AT:
        raw = rng.integers(0, 256, (n, k // fmt.block_values, fmt.block_bytes), dtype=np.uint8)
        for at in SCALES_AT[fmt.name]:
            scales = rng.uniform(0.001, 0.05, (n, k // fmt.block_values)).astype(np.float16)
            raw[:, :, at:at + 2] = scales.view(np.uint8).reshape(n, -1, 2)
        raw = raw.reshape(n, -1)
    else:
        w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, (n, 1))).astype(np.float32)
        raw = quants.quantize(w, kind)
    decoded = quants.dequantize(raw, kind)
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(np.ascontiguousarray(decoded))


@pytest.mark.parametrize("name", sorted(quant.FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("products", ["int8", "exact"])
# few-rows forms up to 8 rows, int8's in passes up to 8-24 rows (48 for Q6_K with VNNI), wide past
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17, 24, 33, 48, 64, 300])
def test_matches_gguf_dequantize_then_f_linear(op, name, dtype, products, rows, int8_products):
    _products(int8_products, products)
    fmt = quant.block_format(name)
    # weights of their own for each case (a row the kernel failed to write must not hold a close answer left
    # by the case before); 102 rows: the wide forms' last group of 16 holds 6, the one-row form's 4 parts
    # leave 2 (3 where two threads take 51 each)
    blocks, w = _blocks(fmt, 102, 768, seed=rows * 100 + sorted(quant.FORMATS).index(name))
    assert blocks.shape == (102, fmt.row_bytes(768)) and blocks.dtype == torch.uint8
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = quant.quant_linear(x, blocks, fmt)
    # integer products (AVX2, VNNI where present): the kernel multiplies x rounded to int8 per block
    want = F.linear(quant.quantize_rows_int8(x, fmt) if products == "int8" else x.float(), w)
    assert got.dtype == dtype and got.shape == (rows, 102)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("name", sorted(quant.FORMATS))
def test_int8_x_is_int8_at_every_row_count(op, name, int8_products):
    """With int8 products every form (the few-rows dots, their passes, the wide product) multiplies x of
    either dtype rounded to int8 per block exactly as quantize_rows_int8 rounds it: bf16's y is F.linear of
    that x rounded to bf16, but where the float32 sums' order tips a value to the next bf16 step (x as it is
    differs in ~70% of them); float32's y is within its sums' order of it (x as it is: ~1e-3 off)."""
    _products(int8_products, "int8")
    fmt = quant.block_format(name)
    blocks, w = _blocks(fmt, 40, 768, seed=7)
    for rows in (1, 8, 9, 25, 33, 49, 300):
        x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)) * 3
        want = F.linear(quant.quantize_rows_int8(x, fmt), w)
        torch.testing.assert_close(quant.quant_linear(x, blocks, fmt), want, rtol=1e-5,
                                   atol=1e-5 * want.abs().max().item(), msg=lambda m: f"float32, {rows} rows: {m}")
        x = x.to(torch.bfloat16)
        want = F.linear(quant.quantize_rows_int8(x, fmt), w)
        got = quant.quant_linear(x, blocks, fmt)
        assert (got != want.bfloat16()).float().mean() <= 0.01, f"{rows} rows"
        torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
@pytest.mark.parametrize("k", [96, 576])   # 3 and 18 blocks a row: groups of 8 blocks and a part one, or only a part
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_rows_of_blocks_not_a_multiple_of_8(op, name, k, rows):
    fmt = quant.block_format(name)
    blocks, w = _blocks(fmt, 40, k, seed=k + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    got = quant.quant_linear(x, blocks, fmt)
    want = F.linear(quant.quantize_rows_int8(x, fmt) if quant.int8_x() else x.float(), w)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("products", ["int8", "exact"])
def test_a_strided_x_and_no_rows(op, products, int8_products):
    _products(int8_products, products)
    fmt = quant.block_format("Q4_1")
    blocks, w = _blocks(fmt, 40, 64, seed=1)
    for rows in (6, 20):                         # the few-rows and the wide forms
        x = torch.randn(64, rows).t()            # rows 1 apart, values `rows` apart
        seen = quant.quantize_rows_int8(x, fmt) if products == "int8" else x
        torch.testing.assert_close(quant.quant_linear(x, blocks, fmt), F.linear(seen, w), rtol=1e-4, atol=1e-4)
    assert quant.quant_linear(torch.empty(0, 64), blocks, fmt).shape == (0, 40)


def test_bad_geometry_is_refused_by_name(op):
    fmt = quant.block_format("Q8_0")
    blocks, _ = _blocks(fmt, 8, 64, seed=2)
    with pytest.raises(RuntimeError, match="takes 102 bytes of blocks a row, got 68"):
        quant.quant_linear(torch.randn(2, 96), blocks, fmt)
    k_blocks, _ = _blocks(quant.block_format("Q4_K"), 8, 256, seed=2)
    with pytest.raises(RuntimeError, match="x's K = 96 is not a whole number of 256-value blocks"):
        op(torch.randn(2, 96), k_blocks, quant.block_format("Q4_K").type_id)
    with pytest.raises(RuntimeError, match="block format 99 is not served"):
        op(torch.randn(2, 64), blocks, 99)


def test_a_format_not_served_is_named():
    with pytest.raises(ValueError, match=r"'IQ2_XS' is not served \(served: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K\)"):
        quant.block_format("IQ2_XS")
    with pytest.raises(ValueError, match="not a whole number of 32-value blocks"):
        quant.block_format("Q8_0").row_bytes(100)


@pytest.mark.parametrize("name", sorted(quant.FORMATS))
def test_rows_by_index_are_gguf_s_decoding(op, name):
    """A quantized embedding's lookup: the rows asked for (repeats too), as gguf decodes them; an id
    outside the rows is refused by value."""
    fmt = quant.block_format(name)
    blocks, w = _blocks(fmt, 50, 512, seed=3)
    ids = torch.tensor([0, 49, 7, 7, 23])
    got = quant.quant_rows(blocks, ids, fmt)
    assert got.dtype == torch.float32 and got.shape == (5, 512)
    torch.testing.assert_close(got, w[ids], rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="id 50 is outside the 50 rows"):
        quant.quant_rows(blocks, torch.tensor([1, 50]), fmt)
    traced = torch.compile(lambda i: quant.quant_rows(blocks, i, fmt), fullgraph=True, backend="eager")
    torch.testing.assert_close(traced(ids), got)


@pytest.mark.parametrize("name", sorted(quant.FORMATS))
def test_the_torch_reference_decodes_as_gguf_does(name):
    """kernels/reference/quant.py, the Triton kernels' oracle on machines without gguf, against gguf's own
    decoder, on random blocks of every bit pattern."""
    from phaseflip.kernels.reference import quant as quant_ref
    fmt = quant.block_format(name)
    blocks = quant_ref.random_blocks(fmt.type_id, 12, 512, seed=5)
    assert blocks.shape == (12, fmt.row_bytes(512)) and blocks.dtype == torch.uint8
    want = torch.from_numpy(quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[name]))
    torch.testing.assert_close(quant_ref.dequantize(blocks, fmt.type_id), want, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(quant.FORMATS))
@pytest.mark.parametrize("limit", [0, 64])   # the wide tile at every row count; the dots in passes up to 64
def test_either_form_at_any_row_count_gives_the_product(op, name, limit, default_few_rows, int8_products):
    """The limit the boot sets (kernels/cpu/few_rows.h) moves rows from one form to the other: both give
    F.linear of x rounded to int8, from 1 row (the wide tile on one row) to 64 (eight passes of dots)."""
    _products(int8_products, "int8")
    fmt = quant.block_format(name)
    blocks, w = _blocks(fmt, 102, 768, seed=11)
    default = quant.few_rows(fmt)
    assert quant.set_few_rows(fmt, limit) == default and quant.few_rows(fmt) == limit
    for rows in (1, 5, 9, 24, 48, 64):
        x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        want = F.linear(quant.quantize_rows_int8(x, fmt), w)
        got = quant.quant_linear(x, blocks, fmt)
        torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-6 * want.abs().max().item(),
                                   msg=lambda m: f"{rows} rows: {m}")
    assert quant.set_few_rows(fmt, None) == limit and quant.few_rows(fmt) == default


def test_a_bad_limit_is_refused_by_value(op, default_few_rows):
    with pytest.raises(RuntimeError, match="rows must be >= 0 .or -1: the default., got -2"):
        quant.set_few_rows(quant.FORMATS["Q8_0"], -2)


def test_the_dots_serve_up_to_the_last_row_count_they_win_from_the_first():
    faster, slower = {"dots": 1.0, "wide": 2.0}, {"dots": 2.0, "wide": 1.0}
    assert forms._dots_limit({9: faster, 12: faster, 16: slower, 24: faster}) == 12
    assert forms._dots_limit({9: slower, 12: faster}) == quant.FEW_ROWS   # not even at the first: 8
    assert forms._dots_limit({9: faster, 48: faster}) == 48


def test_the_boot_measures_each_formats_limit_and_the_products_take_it(op, monkeypatch, default_few_rows,
                                                                       int8_products):
    """choose_block_rows times both forms at every BLOCK_ROWS count for each format of the weights it is
    given, sets each limit by its rule, and a recorded report sets them without timing anything."""
    _products(int8_products, "int8")
    monkeypatch.setattr(forms, "_measured", {})
    weights = [_blocks(quant.FORMATS[name], 64, 512, seed=3)[0].view(64, -1, quant.FORMATS[name].block_bytes)
               for name in ("Q8_0", "Q4_K", "Q8_0")]
    report = forms.choose_block_rows(weights, torch.bfloat16, passes=1, model="m")
    assert set(report["limits"]) == {"Q8_0", "Q4_K"} and report["weights"] == 3
    for name, limit in report["limits"].items():
        table = report["ms"][name]
        assert sorted(table) == list(forms.BLOCK_ROWS) and all(v > 0 for t in table.values() for v in t.values())
        assert limit == forms._dots_limit(table) and quant.few_rows(quant.FORMATS[name]) == limit
    int8_products(False)
    assert forms.choose_block_rows(weights, torch.float32, model="x")["limits"] == {}   # exact: one form
    int8_products(True)

    monkeypatch.setattr(forms, "_block_rows_ms", lambda *a: pytest.fail("a recorded report was measured again"))
    recorded = {**report, "limits": {"Q8_0": 12, "Q4_K": 40}}
    assert forms.choose_block_rows(weights, torch.bfloat16, model="n", recorded=recorded) is recorded
    assert quant.few_rows(quant.FORMATS["Q8_0"]) == 12 and quant.few_rows(quant.FORMATS["Q4_K"]) == 40
