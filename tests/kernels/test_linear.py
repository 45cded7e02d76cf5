"""kernels/cpu/linear.py: every path (weight-stationary, oneDNN on the row ladder, F.linear) equals F.linear,
the ladder pads little and boundedly, and an engine builds no GEMM after boot (warm covered every row
count its steps hand to oneDNN)."""
import pytest
import torch
import torch.nn.functional as F
import torch._dynamo.testing

from phaseflip.engine.llm import LLM
from phaseflip.engine.sampling_params import SamplingParams
from phaseflip.kernels.cpu import linear as lin
from phaseflip.kernels.cpu import forms

HAS_ONEDNN = (getattr(torch.ops.mkldnn, "_linear_pointwise", None) is not None
              and torch.backends.mkldnn.is_available())
ONEDNN = pytest.mark.skipif(not HAS_ONEDNN, reason="this torch build has no oneDNN linear")


@ONEDNN
def test_onednn_self_check_passes_where_the_op_exists():
    """Where torch has oneDNN's linear, its self-check must pass: a failing one would quietly move every
    product to the MKL paths (and skip the tests of the oneDNN forms), so it fails here instead."""
    assert lin.onednn_op(), "oneDNN's linear gave another answer than F.linear on linear.py's self-check"


@pytest.fixture(autouse=True)
def _no_earlier_measurements(monkeypatch):
    """Each test measures for itself: the process keeps every measurement by dtype and model, and every
    form chosen (an engine booted by an earlier test leaves its choices for its dtype)."""
    monkeypatch.setattr(forms, "_measured", {})
    monkeypatch.setattr(lin, "_chosen", {})


@pytest.mark.parametrize("m", [1, 2, 3, lin.SMALL_BATCH, lin.SMALL_BATCH + 1, 40, 64, 65, 100, 512, 600])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(m, with_bias):
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 64, generator=g), torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if with_bias else None
    out = lin.linear(x, w, b)
    assert out.shape == (m, 96) and out.is_contiguous()
    # oneDNN's GEMM (more than SMALL_BATCH rows) sums in another order than MKL's: ~1e-5 of |out| ~ 8
    atol = 1e-5 if m <= lin.SMALL_BATCH else 1e-4
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=atol)


def test_no_rows_gives_no_rows():
    assert lin.linear(torch.empty(0, 8), torch.randn(4, 8)).shape == (0, 4)


def test_the_ladder_covers_every_row_count_with_little_padding():
    sizes = set()
    for m in range(1, 4097):
        b = lin.row_bucket(m)
        assert b >= m and lin.row_bucket(b) == b
        assert b - m < 8 if m <= 64 else (b - m) / m <= 0.125
        sizes.add(b)
    assert len(sizes) == 8 + 8 * 6   # 8 up to 64, then 8 per doubling to 4096


@ONEDNN
def test_warm_runs_each_ladder_size_once_per_distinct_projection():
    w1, w2, b = torch.randn(32, 16), torch.randn(32, 16), torch.randn(32)
    ladder = {lin.row_bucket(m) for m in range(lin.SMALL_BATCH + 1, 101)}
    # w1 and w2 share a shape: one set of GEMMs; the biased one is another
    assert lin.warm([(w1, None, 100), (w2, None, 50), (w1, b, 100)]) == 2 * len(ladder)


@ONEDNN
def test_warm_builds_only_the_sizes_whose_products_take_the_ladder(monkeypatch):
    if not lin.serves("kernel", torch.float32):
        pytest.skip("the CPU kernels did not build here: every size takes the ladder")
    w = torch.randn(32, 16)
    kernel_to_32 = {r: "kernel" if r <= 32 else "ladder" for r in lin.WIDE_ROWS}
    monkeypatch.setitem(lin._chosen, torch.float32, lin.Forms(wide=kernel_to_32))
    assert lin.warm([(w, None, 100)]) == len({lin.row_bucket(m) for m in range(33, 101)})
    monkeypatch.setitem(lin._chosen, torch.float32, lin.Forms(wide=dict.fromkeys(lin.WIDE_ROWS, "kernel")))
    assert lin.warm([(w, None, 100)]) == 0


@ONEDNN
def test_no_gemm_is_built_after_boot(tiny_model_dir, monkeypatch):
    real, rows = lin.onednn_op(), []

    def recording(x, w, b, *args):
        rows.append((tuple(w.shape), b is not None, x.shape[0]))
        return real(x, w, b, *args)
    monkeypatch.setattr(lin, "_onednn", recording)
    monkeypatch.setattr(forms, "choose_wide_forms", lambda *a, **k: {"forms": {}})   # every row count: the ladder
    with LLM(model=str(tiny_model_dir("qwen2")), dtype="float32", max_num_seqs=8, max_model_len=128) as llm:
        at_boot, booted = set(rows), len(rows)
        prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 40, 70, 9, 33)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    served = set(rows[booted:])
    assert served, "the generate never reached oneDNN: the test proves nothing"
    assert served <= at_boot, f"GEMMs built after boot: {sorted(served - at_boot)}"


def test_without_onednn_every_product_takes_the_mkl_paths(monkeypatch):
    monkeypatch.setattr(lin, "_onednn", False)   # as where the build lacks it or its self-check failed
    x, w = torch.randn(40, 16), torch.randn(24, 16)
    torch.testing.assert_close(lin.linear(x, w), F.linear(x, w))
    assert lin.warm([(w, None, 40)]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_step_multiplies_like_the_eager_one(dtype):
    """Traced by torch.compile, one row takes inductor's own reduction and more rows the eager GEMM
    paths as one opaque op: both give the eager answer."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    compiled = torch.compile(lin.linear, dynamic=None)
    for m in (1, lin.GEMV_ROWS + 1, 40):
        x = torch.randn(m, 64, generator=g).to(dtype)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(compiled(x, w, b), lin.linear(x, w, b), rtol=tol, atol=tol * 8)


def test_the_kernel_is_kept_unless_another_form_is_clearly_faster():
    near, clear = 1 - forms.KERNEL_MARGIN / 2, 1 - 2 * forms.KERNEL_MARGIN
    assert forms._fastest({"kernel": 10.0, "stationary": 10.0 * near, "library": 30.0}) == "kernel"
    assert forms._fastest({"kernel": 10.0, "stationary": 10.0 * clear, "library": 30.0}) == "stationary"
    assert forms._fastest({"stationary": 9.0, "library": 8.0}) == "library"   # no kernel: the fastest


@pytest.mark.parametrize("wide", ["kernel", "ladder"])
def test_where_the_kernel_serves_every_row_count_one_graph_serves_them_all(wide):
    """A compiled step's products test the row count only where the forms differ by it: where the
    kernel serves every row count, one graph compiled at 2 rows (rows dynamic) serves 3, 4 and 64
    (a cold boot compiles one decode step, not three); where they differ, it specialises."""
    _kernel_or_skip()
    lin.follow(torch.float32, small=dict.fromkeys(lin.MEASURED_ROWS, "kernel"),
               wide=dict.fromkeys(lin.WIDE_ROWS, wide))
    g = torch.Generator().manual_seed(2)
    w = torch.randn(96, 64, generator=g)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(lambda x: lin.linear(x, w), backend=counter, dynamic=True)
    for m in (2, 3, 4, 64):
        x = torch.randn(m, 64, generator=g)
        torch.testing.assert_close(compiled(x), F.linear(x, w), rtol=1e-4, atol=1e-4)
    assert counter.frame_count == (1 if wide == "kernel" else 3)


@pytest.mark.parametrize("form", lin.SMALL_FORMS)
def test_every_small_rows_form_equals_f_linear(form, monkeypatch):
    if form == "kernel":
        _kernel_or_skip()
    lin.follow(torch.float32, small=dict.fromkeys(lin.MEASURED_ROWS, form))
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    for m in range(1, lin.SMALL_BATCH + 1):
        x = torch.randn(m, 64, generator=g)
        assert lin.form(m, x.dtype) == form
        torch.testing.assert_close(lin.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_the_measured_small_rows_form_is_the_one_that_runs(monkeypatch):
    report = forms.choose_small_forms([torch.randn(256, 64), torch.randn(64, 256)], passes=1)
    chosen = {m: lin.form(m, torch.float32) for m in lin.MEASURED_ROWS}
    assert chosen == report["forms"] and report["choice"] == ", ".join(f"{m} rows: {f}" for m, f in chosen.items())
    for m in lin.MEASURED_ROWS:   # the choice is the fastest of what was timed (the kernel on a near tie)
        ms = report["ms"][m]
        assert all(v > 0 for v in ms.values()) and chosen[m] == forms._fastest(ms)
    ran = []
    real = lin.product
    monkeypatch.setattr(lin, "product", lambda form, *a: ran.append(form) or real(form, *a))
    lin.linear(torch.randn(2, 64), torch.randn(8, 64))
    assert ran == [lin.form(2, torch.float32)] == [chosen[2]]
    bf16 = forms.choose_small_forms([torch.randn(64, 64, dtype=torch.bfloat16)], passes=1)
    assert bf16 is not report and bf16["dtype"] == "torch.bfloat16"


def test_each_model_is_measured_once_and_its_own_forms_serve_it(monkeypatch):
    """Per process, dtype and model: another layout of a model takes its report; another model is
    measured, and its forms are the ones that run (a tiny model measured first once put SmolLM2's one-row
    products on the library's product)."""
    timed = []
    monkeypatch.setattr(forms, "_best_pass_ms", lambda form, xs, weights, passes: timed.append(len(weights)) or
                        {"kernel": 2.0, "library": 1.0}.get(form, 3.0) * (1 if len(weights) == 2 else -1))
    first = forms.choose_small_forms([torch.randn(256, 64), torch.randn(64, 256)], model="a")
    assert timed and forms.choose_small_forms([torch.randn(128, 64)], model="a") is first   # a's TP layout
    assert len(set(timed)) == 1 and lin.form(1, torch.float32) == first["forms"][1]
    other = forms.choose_small_forms([torch.randn(8, 8)] * 3, model="b")   # another model: measured anew
    assert other is not first and 3 in timed and lin.form(1, torch.float32) == other["forms"][1]
    assert forms.choose_small_forms([torch.randn(8, 8)] * 3) is not other   # unnamed: named by its shapes
    assert forms.choose_small_forms([torch.randn(256, 64)], model="a") is first
    assert lin.chosen(torch.float32).small == first["forms"]


@pytest.mark.parametrize("choice, form, runs_eager", [("reduction", "stationary", False),
                                                      ("library", "stationary", True),
                                                      ("library", "library", False)])
def test_a_compiled_one_row_product_takes_the_measured_form(choice, form, runs_eager, monkeypatch):
    """Inductor's reduction; or the eager small-rows form through the opaque op; or, where that form is
    the library's product, inductor's own extern call to it (no Python inside the step)."""
    lin.follow(torch.float32, one_row=choice, small=dict.fromkeys(lin.MEASURED_ROWS, form))
    reduces = lin.form(1, torch.float32, traced=True) == "reduction"
    assert reduces == (choice == "reduction") and lin.form(1, torch.bfloat16, traced=True) == "reduction"
    ran, real = [], lin.product   # the forms run eager (inside the opaque op), not those traced
    monkeypatch.setattr(lin, "product", lambda form, *a: (None if torch.compiler.is_compiling() else
                                                          ran.append(form)) or real(form, *a))
    w, x = torch.randn(96, 64), torch.randn(1, 64)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(lin.linear)(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    assert ran == ([form] if runs_eager else [])


def test_choose_gemv_reports_both_timings(monkeypatch):
    layers = [(torch.randn(96, 64), torch.randn(64, 96)) for _ in range(3)]
    report = forms.choose_gemv(layers, repeats=1)
    assert "reduction" in report["ms"] and len(report["ms"]) == 2
    assert report["choice"] == min(report["ms"], key=report["ms"].get)
    assert report["layers"] == 3 and report["pass_bytes"] == 3 * 2 * 96 * 64 * 4
    assert (lin.form(1, torch.float32, traced=True) == "reduction") == (report["choice"] == "reduction")
    assert forms.choose_gemv([(torch.randn(96, 64), torch.randn(64, 96))] * 3) is report   # the same shapes


def test_choose_gemv_gives_bf16_to_the_kernel_unmeasured(monkeypatch):
    """The layer pass misjudged bfloat16 (linear.BF16_KERNEL): where the kernel serves it, no pass runs
    and the report says why; float32 is still measured (the tests above)."""
    monkeypatch.setattr(lin, "form", lambda m, dtype, traced=False: "kernel")
    monkeypatch.setattr(forms, "_one_row_products", lambda *a, **k: pytest.fail("a pass was timed"))
    report = forms.choose_gemv([(torch.randn(96, 64, dtype=torch.bfloat16),)])
    assert report["choice"] == "kernel" and report["ms"] is None and report["reason"] == forms.BF16_KERNEL
    assert lin.chosen(torch.bfloat16).one_row == "kernel"


def test_choose_gemv_times_whole_passes_over_the_layers_alternating(monkeypatch):
    """One weight timed alone misled (the forms within 1% on the head, the compiled step 40% apart):
    each timed run is a pass over every layer, the two forms taking turns."""
    layers = [(torch.randn(96, 64), torch.randn(64, 96)) for _ in range(3)]
    passes = []
    real = forms._best_ms
    monkeypatch.setattr(forms, "_best_ms", lambda fn, repeats, before=None: passes.append(fn) or real(fn, repeats))
    seen = []
    real_products = forms._one_row_products
    monkeypatch.setattr(forms, "_one_row_products",
                        lambda xs, ws, form: seen.append((form, len(ws))) or real_products(xs, ws, form))
    torch._dynamo.reset()
    try:
        report = forms.choose_gemv(layers, repeats=2)
    finally:
        torch._dynamo.reset()
    form = lin.form(1, torch.float32)
    assert len(passes) == 4   # 2 rounds x (reduction pass, eager pass)
    # one warm-up call per form on the first layer, then each round a whole pass per form, in turn
    one_round = [("reduction", 2)] * 3 + [(form, 2)] * 3
    assert seen == [("reduction", 2), (form, 2)] + one_round * 2, seen
    assert set(report["ms"]) == {"reduction", form}


def _kernel_or_skip():
    """Asked inside a test (not at collection: loading the kernels then would read the user's cache)."""
    if not lin.serves("kernel", torch.float32):
        pytest.skip("the few-rows kernel did not build here (test_cpu_kernels says why)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [lin.SMALL_BATCH + 1, 8, 16, 17, 33, 63, 64])
def test_the_kernel_multiplies_wide_rows_like_f_linear(dtype, m):
    """Past SMALL_BATCH rows the kernel transposes x and broadcasts weight values: every 16-row group
    (and its padding), weight rows past the last whole group of the tile, an odd K (a bf16 pair's tail)."""
    _kernel_or_skip()
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 131, generator=g).to(dtype), torch.randn(203, 131, generator=g).to(dtype)
    want = F.linear(x.float(), w.float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(lin.product("kernel", x, w, None).float(), want, rtol=tol, atol=tol * 8)


@pytest.mark.parametrize("form", ["kernel", "ladder"])
def test_every_wide_rows_form_equals_f_linear(form, monkeypatch):
    if form == "kernel":
        _kernel_or_skip()
    lin.follow(torch.float32, wide=dict.fromkeys(lin.WIDE_ROWS, form))
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    for m in (lin.SMALL_BATCH + 1, 9, 40, lin.WIDE_ROWS[-1], lin.WIDE_ROWS[-1] + 77):   # the last: passes
        x = torch.randn(m, 64, generator=g)
        assert lin.form(m, x.dtype) == form
        torch.testing.assert_close(lin.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert lin.form(3 * lin.WIDE_ROWS[-1], torch.float32) == form   # past them, the last timed form
    assert lin.form(0, torch.float32) == "ladder" and lin.linear(torch.empty(0, 64), w).shape == (0, 96)


def test_the_measured_wide_rows_form_is_the_one_that_runs(monkeypatch):
    _kernel_or_skip()
    assert lin.form(8, torch.float32) == "ladder"   # unmeasured: the ladder, as before the kernel grew
    report = forms.choose_wide_forms([torch.randn(256, 64), torch.randn(64, 256)], passes=1)
    for m in lin.WIDE_ROWS:   # the choice is the fastest of what was timed (the kernel on a near tie), and it runs
        ms = report["ms"][m]
        assert all(v > 0 for v in ms.values()) and report["forms"][m] == forms._fastest(ms)
        assert lin.form(m, torch.float32) == lin.form(m - 1, torch.float32) == report["forms"][m]
    ran = []
    real = lin.product
    monkeypatch.setattr(lin, "product", lambda form, *a: ran.append(form) or real(form, *a))
    lin.linear(torch.randn(30, 64), torch.randn(8, 64))
    assert ran == [report["forms"][32]]
    assert forms.choose_wide_forms([torch.randn(64, 256), torch.randn(256, 64)]) is report   # the same shapes


@ONEDNN
def test_a_widened_bf16_ladder_product_is_float32_onednn_rounded_to_bf16(monkeypatch):
    lin.follow(torch.bfloat16, ladder="widened")
    real, ran = lin.onednn_op(), []
    monkeypatch.setattr(lin, "_onednn", lambda x, *a: ran.append(x.dtype) or real(x, *a))
    x, w, b = (torch.randn(*s).to(torch.bfloat16) for s in ((100, 48), (40, 48), (40,)))
    got = lin.linear(x, w, b)
    assert got.dtype == torch.bfloat16 and ran == [torch.float32]
    torch.testing.assert_close(got, F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16))
    monkeypatch.setattr(lin, "WIDEN_BYTES", 4 * 48 * 16)   # 16 weight rows widened at a time: 3 blocks
    torch.testing.assert_close(lin.linear(x, w, b), got)
    assert ran == [torch.float32] * 4
    monkeypatch.setattr(lin, "_chosen", {})   # unmeasured: the library's bf16 product
    lin.linear(x, w, b)
    assert ran == [torch.float32] * 4


@ONEDNN
def test_choose_ladder_form_times_bf16_only(monkeypatch):
    assert forms.choose_ladder_form([torch.randn(32, 16)])["ms"] is None   # float32 is on oneDNN already
    report = forms.choose_ladder_form([torch.randn(32, 16).to(torch.bfloat16)], passes=1)
    assert set(report["ms"]) == {"library", "widened"} and report["rows"] == forms.LADDER_PROBE_ROWS
    assert report["choice"] == min(report["ms"], key=report["ms"].get)
    assert (lin.form(100, torch.bfloat16) == "widened") == (report["choice"] == "widened")
    assert forms.choose_ladder_form([torch.randn(32, 16).to(torch.bfloat16)]) is report   # the same shapes


@ONEDNN
def test_no_widened_gemm_is_built_after_boot(tiny_model_dir, monkeypatch):
    widened = {"choice": "widened"}
    lin.follow(torch.bfloat16, ladder="widened")
    monkeypatch.setattr(forms, "choose_ladder_form", lambda *a, **k: widened)  # kept
    real, rows = lin.onednn_op(), []
    monkeypatch.setattr(lin, "_onednn", lambda x, w, b, *a: rows.append((tuple(w.shape), x.shape[0])) or
                        real(x, w, b, *a))
    monkeypatch.setattr(forms, "choose_wide_forms", lambda *a, **k: {"forms": {}})   # every row count: the ladder
    with LLM(model=str(tiny_model_dir("llama")), dtype="bfloat16", max_num_seqs=8, max_model_len=128) as llm:
        at_boot, booted = set(rows), len(rows)
        prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 70, 9)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    served = set(rows[booted:])
    assert served, "the generate never reached the widened ladder: the test proves nothing"
    assert served <= at_boot, f"GEMMs built after boot: {sorted(served - at_boot)}"
