"""A GGUF file of mixed block formats served as it is, as llama.cpp's Q4_K_M files are made: Q4_K and Q6_K
(256-value blocks), Q5_0 / Q5_1 / Q8_0 (32), a fused projection whose parts differ in format (q and k in
one, v in another: a Split), layers that differ from each other. Held to HF transformers on what the
file's blocks decode to (gguf's decoder) and two ranks flipping every step to one rank, the products exact
(x as it is); a boot with int8 products measures each format's few-rows limit and records it."""
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package (a dependency) is not installed")

from phaseflip import LLM, SamplingParams  # noqa: E402
from phaseflip.engine.checkpoint import gguf_model  # noqa: E402
from phaseflip.engine.checkpoint.tokenizer import load_tokenizer  # noqa: E402
from phaseflip.kernels.cpu import forms, quant  # noqa: E402
from tests.gguf_files import dequantized_reference, write_llama_gguf  # noqa: E402
from tests.models import hf_greedy, make_tiny_model  # noqa: E402

PROMPTS = ("The quick brown fox", "What is 2 + 2?", "Hello, world!", "Pack my box", "Sphinx of black quartz",
           "A large language model", "Numbers 0123456789", "Pipeline parallel stages hold layers")
AGREEMENT = 0.90   # greedy tokens equal to HF's on the decoded weights (the quantized kernels' exact products
#                    differ from F.linear's in summation order)


def _kinds(layers: int) -> dict[str, str]:
    """Q4_K_M's make-up over `layers` layers: q and k Q4_K, v Q6_K or Q8_0 (a Split) except in the last
    layer (Q4_K: one stacked weight), o Q5_0, gate and up Q5_1 (in layer 1 gate Q4_K: a Split), down
    Q6_K in layer 0 and Q4_K after, the tied embedding Q8_0."""
    kinds = {"model.embed_tokens.weight": "Q8_0"}
    for i in range(layers):
        p = f"model.layers.{i}."
        v = "Q4_K" if i == layers - 1 else ("Q6_K", "Q8_0")[i % 2]
        kinds.update({p + "self_attn.q_proj.weight": "Q4_K", p + "self_attn.k_proj.weight": "Q4_K",
                      p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": "Q5_0",
                      p + "mlp.gate_proj.weight": "Q4_K" if i == 1 else "Q5_1", p + "mlp.up_proj.weight": "Q5_1",
                      p + "mlp.down_proj.weight": "Q6_K" if i == 0 else "Q4_K"})
    return kinds


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory):
    """(the GGUF file, the HF checkpoint of its decoded blocks): a llama of hidden 256 (one 256-value
    block a row), 4 query heads of 64 over 2 KV heads, MLP 512, 3 layers, tied embedding."""
    hf = make_tiny_model("llama", tmp_path_factory.mktemp("k-hf"), num_layers=3, tie=True, hidden_size=256,
                         intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    out = tmp_path_factory.mktemp("k-gguf") / "tiny-Q4_K_M.gguf"
    decoded = write_llama_gguf(hf, out, _kinds(3))
    return out, dequantized_reference(hf, decoded, tmp_path_factory.mktemp("k-ref"))


def _greedy(llm, n=24):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(list(PROMPTS), params, use_tqdm=False)]


def test_the_file_serves_as_hf_runs_its_decoded_blocks(k_quant_file):
    path, reference = k_quant_file
    assert gguf_model.quantized_types(path) == {"Q4_K", "Q5_0", "Q5_1", "Q6_K", "Q8_0"}
    assert gguf_model.column_units(path) == (32, 256)
    with LLM(str(path), block_products="exact") as llm:
        ours = _greedy(llm)
        report = llm.inspect()["ranks"][0]["weights"]["pp"]
    storage = report["storage"]
    assert (storage["layers.0.qkv_proj.0"], storage["layers.0.qkv_proj.2"]) == ("Q4_K", "Q6_K")
    assert (storage["layers.2.qkv_proj"], storage["layers.1.gate_up_proj.0"]) == ("Q4_K", "Q4_K")
    assert storage["layers.0.gate_up_proj"] == "Q5_1" and storage["layers.0.down_proj"] == "Q6_K"
    tok = load_tokenizer(reference)
    want = [ids for ids, _ in hf_greedy(reference, [tok.encode(p) for p in PROMPTS], 24)]
    same = sum(a == b for x, y in zip(ours, want) for a, b in zip(x, y))
    total = sum(len(y) for y in want)
    print(f"mixed K-quant file vs HF on its decoded blocks: {same}/{total} greedy tokens equal")
    assert same >= AGREEMENT * total


def test_two_ranks_flipping_every_step_give_one_ranks_tokens(k_quant_file):
    path, _ = k_quant_file
    with LLM(str(path), block_products="exact") as llm:
        want = _greedy(llm, 12)
    with LLM(str(path), world_size=2, layouts=("pp", "tp"), flip_every_steps=1, block_products="exact") as llm:
        assert _greedy(llm, 12) == want
        assert llm.stats()["flips"] >= 6


def test_a_phi3_file_with_its_fused_tensors_serves_as_hf_runs_it(tmp_path):
    """llama.cpp's phi3 layout: q/k/v rows in one attn_qkv, gate/up rows in one ffn_up; served as row views
    of the blocks (Q8_0 and Q5_1 here), greedy tokens against HF on the decoded blocks."""
    hf = make_tiny_model("phi3", tmp_path / "hf", num_layers=2)
    kinds = {}
    for i in range(2):
        p = f"model.layers.{i}."
        kinds.update({p + "self_attn.qkv_proj.weight": "Q8_0", p + "mlp.gate_up_proj.weight": "Q5_1",
                      p + "self_attn.o_proj.weight": "Q8_0", p + "mlp.down_proj.weight": "Q8_0"})
    out = tmp_path / "gguf"
    out.mkdir()
    decoded = write_llama_gguf(hf, out / "tiny-phi3.gguf", kinds, arch="phi3")
    reference = dequantized_reference(hf, decoded, tmp_path / "ref")
    assert gguf_model.quantized_types(out / "tiny-phi3.gguf") == {"Q8_0", "Q5_1"}
    with LLM(str(out / "tiny-phi3.gguf"), block_products="exact") as llm:
        assert llm.model_config.architecture == "Phi3ForCausalLM"
        ours = _greedy(llm)
    tok = load_tokenizer(reference)
    want = [ids for ids, _ in hf_greedy(reference, [tok.encode(p) for p in PROMPTS], 24)]
    same = sum(a == b for x, y in zip(ours, want) for a, b in zip(x, y))
    print(f"phi3 GGUF vs HF on its decoded blocks: {same}/{sum(map(len, want))} greedy tokens equal")
    assert same >= AGREEMENT * sum(map(len, want))


def test_an_int8_boot_measures_each_formats_few_rows_limit_and_a_second_boot_takes_it(k_quant_file, monkeypatch,
                                                                                     default_few_rows, int8_products):
    """Int8 products on blocks (the default where the CPU has integer dots): the boot times the few-rows
    dots against the wide tile for each format of the first layer (forms.choose_block_rows) and reports the
    limits it set; the next boot of the same key takes them from its record."""
    path, _ = k_quant_file
    if not quant.has_int8_dot():
        pytest.skip("this CPU's kernels have no integer dots (AVX2): one form")
    reports = []
    for _ in range(2):   # the rank runs in this process (its limits undone by default_few_rows)
        monkeypatch.setattr(forms, "_measured", {})   # a fresh process as far as the measured forms go
        with LLM(str(path), block_products="int8") as llm:
            reports.append(llm.inspect()["ranks"][0]["compile"]["pp"])
    first, again = (r["block_rows"] for r in reports)
    assert set(first["limits"]) == {"Q4_K", "Q6_K", "Q5_0", "Q5_1"}   # layer 0's formats
    for name, limit in first["limits"].items():
        assert limit in (quant.FEW_ROWS, *forms.BLOCK_ROWS) and sorted(first["ms"][name]) == list(forms.BLOCK_ROWS)
    assert not reports[0]["record"]["used"] and reports[1]["record"]["used"] and again == first
