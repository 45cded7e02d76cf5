"""A GGUF file served as it is (engine/checkpoint/gguf_model.py, gguf_file.py): the shipped SmolLM2 Q4_1
file's config, tokenizer and weights against the fp32 checkpoint transformers converted from it (its
blocks decode to exactly those values, llama.cpp's q/k row order undone), greedy tokens against that
dequantized run, two ranks flipping every step against one; the header reader against gguf's own; what
is not served refused by name before any weight is read."""
import json
import math

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package (a dependency) is not installed")
from gguf import quants  # noqa: E402

from phaseflip import LLM, SamplingParams  # noqa: E402
from phaseflip.cache import cache_dir  # noqa: E402
from phaseflip.engine.checkpoint import gguf_model  # noqa: E402
from phaseflip.engine.checkpoint.default_model import find_default_gguf  # noqa: E402
from phaseflip.engine.checkpoint.gguf_file import StringArray, read_gguf  # noqa: E402
from phaseflip.engine.checkpoint.loader import CheckpointError, load_model_config, load_weights  # noqa: E402
from phaseflip.engine.checkpoint.tokenizer import load_tokenizer  # noqa: E402
from phaseflip.kernels.cpu import quant  # noqa: E402
from tests import background  # noqa: E402
from tests.models import SMOLLM_TEXTS  # noqa: E402

T = gguf.GGMLQuantizationType
AGREEMENT = 0.90   # the issue's floor: greedy Q4_1 tokens equal to the dequantized run's


# gguf's own reader of the shipped file, beside the suite (it parses the whole file in numpy): each
# metadata field (a list of strings as its length and its strings joined) and each tensor's name, offset
# and size, as JSON
GGUFS_OWN_HEADER = """
import json, sys, gguf
reader, fields = gguf.GGUFReader(sys.argv[1]), {}
for key, field in reader.fields.items():
    if not key.startswith("GGUF."):   # the header's own counts, not metadata
        value = field.contents()
        strings = isinstance(value, list) and value and isinstance(value[0], str)
        fields[key] = {"strings": len(value), "text": "\\n".join(value)} if strings else value
print(json.dumps({"fields": fields, "tensors": [[t.name, int(t.data_offset), int(t.n_bytes)] for t in reader.tensors]}))
"""


@background.register("ggufs_own_header")
def _read_with_ggufs_reader(session: background.Session) -> background.Job:
    return background.python("-c", GGUFS_OWN_HEADER, str(find_default_gguf()))


@pytest.fixture(scope="module")
def q4_1():
    return find_default_gguf()


@pytest.fixture(scope="module")
def ggufs_own_header(_background_jobs):
    return json.loads(_background_jobs["ggufs_own_header"].stdout("gguf's reader of the shipped file"))


def test_config_and_tokenizer_are_the_converted_models(q4_1, default_model_dir):
    ours, converted = load_model_config(q4_1), load_model_config(default_model_dir)
    assert ours.torch_dtype is None and ours == type(converted)(**{**converted.__dict__, "torch_dtype": None})
    tok, want = load_tokenizer(q4_1), load_tokenizer(default_model_dir)   # built from its metadata
    built = gguf_model.gguf_tokenizer_dir(q4_1, cache_dir())
    # what transformers' converter wrote, from the same metadata
    assert json.loads((built / "tokenizer.json").read_text()) == \
        json.loads((default_model_dir / "tokenizer.json").read_text())
    assert (built / "chat_template.jinja").read_text() == (default_model_dir / "chat_template.jinja").read_text()
    for text in SMOLLM_TEXTS:
        assert tok.encode(text) == want.encode(text)
    chat = [{"role": "user", "content": "Hi"}]
    assert tok.encode_chat(chat) == want.encode_chat(chat)


def test_blocks_decode_to_the_converted_weights(q4_1, default_model_dir):
    cfg = load_model_config(default_model_dir)
    ours, converted = load_weights(q4_1, cfg, torch.float32), load_weights(default_model_dir, cfg, torch.float32)
    assert ours.keys() == converted.keys()
    kinds = set()
    for name, want in converted.items():
        t, fmt = ours[name], quant.weight_format(ours[name])
        kinds.add(quant.storage(t))
        got = t if fmt is None else quant.dequantize(t.flatten(1), fmt)
        assert torch.equal(got, want), name   # q_proj/k_proj: only with llama.cpp's row order undone
    assert kinds == {"Q4_1", "Q8_0", "float32"}


def _greedy(llm, n=32):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(SMOLLM_TEXTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def one_rank_run(q4_1):
    """The shipped file on one rank, its blocks' products exact (x as it is, as the dequantized run takes
    it): its greedy tokens (8 prompts x 32) and its manifest."""
    with LLM(str(q4_1), block_products="exact") as llm:
        assert llm.model_config.tie_word_embeddings
        return _greedy(llm), llm.inspect()


def test_q4_1_greedy_tokens_agree_with_the_dequantized_run(q4_1, one_rank_run, default_model_dir):
    ours, manifest = one_rank_run
    _check_weights_report(manifest, q4_1)
    with LLM(str(default_model_dir)) as llm:
        want = _greedy(llm)
    same = sum(a == b for x, y in zip(ours, want) for a, b in zip(x, y))
    total = sum(len(y) for y in want)
    print(f"Q4_1 vs dequantized fp32: {same}/{total} greedy tokens equal")
    assert same >= AGREEMENT * total


def _check_weights_report(manifest, path):
    """The manifest counts the file's quantized bytes as stored, and a decode token reads them all (the
    embedding is tied to the head, which reads it whole)."""
    from phaseflip.tools.inspect_cmd import weights_table
    file = read_gguf(path)
    stored = {}
    for info in file.tensors.values():
        kind = "float32" if info.type_id == T.F32 else T(info.type_id).name
        stored[kind] = stored.get(kind, 0) + info.num_bytes
    report = manifest["ranks"][0]["weights"]["pp"]
    assert report["bytes_by_storage"]["Q4_1"] == stored["Q4_1"]
    assert report["bytes_by_storage"]["Q8_0"] == stored["Q8_0"]
    assert report["storage"]["layers.0.qkv_proj"] == "Q4_1" and report["storage"]["lm_head"] == "Q8_0"
    assert report["bytes_read_per_token"] == sum(report["bytes_by_storage"].values())
    assert report["block_products_x"] == "as it is, never rounded (exact)"   # the run's block_products
    table = "\n".join(weights_table(manifest))
    assert "Q4_1 " in table and "blocks multiply x as it is, never rounded (exact)" in table


def test_two_ranks_flipping_every_step_give_one_ranks_tokens(q4_1, one_rank_run):
    """Exact products (x as it is): the ranks' sums in another order move no token. With int8 x they can (a
    value at a rounding step's edge rounds to the next step, as in bf16)."""
    with LLM(str(q4_1), world_size=2, layouts=("pp", "tp"), flip_every_steps=1, block_products="exact") as llm:
        assert _greedy(llm, 16) == [tokens[:16] for tokens in one_rank_run[0]]
        assert llm.stats()["flips"] >= 10


def _perplexity(llm, ids: list[int], ctx: int = 256) -> float:
    """llama-perplexity's protocol (benchmarks/perplexity.py): windows of ctx tokens, in each the tokens
    after its first half scored given every token before them in the window."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    nll = []
    for start in range(0, len(ids) - ctx + 1, ctx):
        part = ids[start:start + ctx]
        out = llm.generate([{"prompt_token_ids": part}], params, use_tqdm=False)[0]
        nll += [-out.prompt_logprobs[j][part[j]] for j in range(ctx // 2 + 1, ctx)]
    return math.exp(sum(nll) / len(nll))


def test_the_default_int8_products_score_a_text_as_the_exact_ones_do(q4_1, one_rank_run, int8_products):
    """block_products="auto" takes x rounded to int8 per block where the CPU has integer dots (llama.cpp's
    numerics and speed): the shipped file's perplexity on a text (Python's reference topics) within 1% of
    the exact products'. Greedy tokens are no measure here: a near tie goes either way (printed)."""
    if not quant.has_int8_dot():
        pytest.skip("this CPU's kernels have no integer dots (AVX2): auto takes x as it is")
    from pydoc_data.topics import topics
    body = "\n\n".join(topics[k] for k in sorted(topics))[:6000]
    with LLM(str(q4_1), max_model_len=512) as llm:
        report = llm.inspect()["ranks"][0]["weights"]["pp"]
        assert report["block_products_x"].startswith("rounded to int8 per block")
        ids = llm.get_tokenizer().encode(body, add_special_tokens=False)
        ours, tokens = _perplexity(llm, ids), _greedy(llm)
    with LLM(str(q4_1), max_model_len=512, block_products="exact") as llm:
        exact = _perplexity(llm, ids)
    same = sum(a == b for x, y in zip(tokens, one_rank_run[0]) for a, b in zip(x, y))
    print(f"Q4_1, int8 x: perplexity {ours:.4f} against exact {exact:.4f} over {len(ids)} tokens; "
          f"{same}/{sum(map(len, tokens))} greedy tokens equal to the exact run's")
    assert abs(ours / exact - 1) <= 0.01


def test_block_products_are_checked_before_any_work(q4_1, monkeypatch):
    """A value not served, int8 where no CPU kernel takes it (CUDA's Triton kernels decode the blocks; a CPU
    without integer dots), each refused naming what is allowed; auto takes what the device can."""
    from phaseflip.engine.boot import resolve_block_products
    with pytest.raises(ValueError, match="block_products='int4' is invalid: allowed are auto, int8, exact"):
        LLM(str(q4_1), block_products="int4")
    with pytest.raises(ValueError, match="block_products='int8' is the CPU kernels'.*allowed there: auto, exact"):
        resolve_block_products("int8", "cuda", {"Q4_1"})
    assert resolve_block_products("auto", "cuda", {"Q4_1"}) == "exact"
    assert resolve_block_products("int8", "cpu", set()) is None   # no blocks: nothing to set
    monkeypatch.setattr(quant, "has_int8_dot", lambda: False)
    with pytest.raises(ValueError, match="needs the CPU kernels' integer dots.*allowed here: auto, exact"):
        resolve_block_products("int8", "cpu", {"Q4_1"})
    assert resolve_block_products("auto", "cpu", {"Q4_1"}) == "exact"


def _write(path, arch="llama", tensors=None, **metadata):
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        writer.add_key_value(key, value, gguf.GGUFValueType.STRING if isinstance(value, str) else
                             gguf.GGUFValueType.UINT32)
    for name, (values, kind) in (tensors or {}).items():
        stored = values if kind == T.F32 else quants.quantize(values, kind)
        writer.add_tensor(name, stored, raw_dtype=None if kind == T.F32 else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_an_architecture_not_served_is_refused_by_name(tmp_path):
    _write(tmp_path / "g.gguf", arch="gemma2")
    with pytest.raises(CheckpointError, match="general.architecture='gemma2' is not served"):
        load_model_config(tmp_path / "g.gguf")


def test_rope_scaling_is_refused(tmp_path):
    _write(tmp_path / "r.gguf", **{"llama.rope.scaling.type": "yarn"})
    with pytest.raises(CheckpointError, match=r"rope scaling \(yarn\)"):
        load_model_config(tmp_path / "r.gguf")


def test_a_truncated_file_is_refused_before_its_weights_are_read(tmp_path, q4_1):
    data = q4_1.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match="runs past the end of the file"):
        read_gguf(tmp_path / "cut.gguf")


def test_rows_unpermuted_as_transformers_does():
    rows = torch.arange(2 * 8 * 3).view(16, 3)   # 2 heads of 8 rows: llama.cpp's order -> HF's
    got = gguf_model._unpermute(rows, heads=2)
    want = torch.cat([rows[h * 8:(h + 1) * 8][[0, 2, 4, 6, 1, 3, 5, 7]] for h in range(2)])
    assert torch.equal(got, want)


def test_quantized_types_names_the_blocks(q4_1, default_model_dir):
    assert gguf_model.quantized_types(q4_1) == {"Q4_1", "Q8_0"}
    assert gguf_model.quantized_types(default_model_dir) == set()


def test_a_quantized_tp_share_keeps_whole_blocks():
    from phaseflip.rank.weights import _cols
    w = torch.from_numpy(quants.quantize(np.ones((4, 128), np.float32), T.Q8_0)).view(4, 4, 34)
    assert _cols(w, 32, 64).shape == (4, 2, 34)
    with pytest.raises(ValueError, match=r"columns \[16, 80\) are not whole 32-value blocks"):
        _cols(w, 16, 64)


def _phi3_header(path, tensors=(), **extra):
    """A phi3 GGUF holding only what its config needs (the engine's own writer)."""
    from phaseflip.engine.checkpoint.gguf_file import write_gguf
    meta = {"general.architecture": "phi3", "phi3.context_length": 256, "phi3.embedding_length": 64,
            "phi3.feed_forward_length": 128, "phi3.block_count": 1, "phi3.attention.head_count": 4,
            "phi3.attention.key_length": 16, "phi3.attention.layer_norm_rms_epsilon": 1e-5, **extra}
    table = {"token_embd.weight": (0, (384, 64), bytes(384 * 64 * 4))}
    table.update({name: (0, (8,), bytes(32)) for name in tensors})
    write_gguf(path, meta, table)
    return path


def test_a_mixture_of_experts_file_is_refused_by_name(tmp_path):
    with pytest.raises(CheckpointError, match=r"phi3.expert_count=8: a mixture of experts"):
        load_model_config(_phi3_header(tmp_path / "moe.gguf", **{"phi3.expert_count": 8}))


def test_phi3_files_keep_their_window_and_refuse_a_partial_or_scaled_rotary(tmp_path):
    cfg = load_model_config(_phi3_header(tmp_path / "a.gguf", **{"phi3.attention.sliding_window": 100}))
    assert cfg.architecture == "Phi3ForCausalLM" and cfg.head_dim == 16
    assert cfg.windows == (100,) * cfg.num_layers and cfg.max_position_embeddings > 100
    with pytest.raises(CheckpointError, match=r"phi3.rope.dimension_count=12 rotates part of the 16-value head"):
        load_model_config(_phi3_header(tmp_path / "b.gguf", **{"phi3.rope.dimension_count": 12}))
    with pytest.raises(CheckpointError, match=r"rope scaling \(rope_factors_long.weight\)"):
        load_model_config(_phi3_header(tmp_path / "c.gguf", tensors=("rope_factors_long.weight",)))


def test_a_llama3_scaled_file_reads_its_rope_freqs_and_serves_as_hf(tiny_model_dir, tmp_path):
    """Llama 3.1+ GGUFs carry llama3 rope scaling as rope_freqs (a divisor per frequency, llama.cpp's
    converter's formula): an F32 file of the tiny llama3-rope model gives HF's greedy tokens."""
    from tests.gguf_files import write_llama_gguf
    from tests.models import compare_greedy, hf_greedy
    from phaseflip.engine.checkpoint.tokenizer import load_tokenizer
    from phaseflip.kernels.reference.rotary import inv_frequencies
    hf = tiny_model_dir("llama3rope")
    write_llama_gguf(hf, tmp_path / "l3.gguf", {})
    cfg, want_cfg = load_model_config(tmp_path / "l3.gguf"), load_model_config(hf)
    assert len(cfg.rope_scaling.factors) == 8 and cfg.rope_theta == want_cfg.rope_theta == 500000.0
    torch.testing.assert_close(inv_frequencies(16, cfg.rope_theta, cfg.rope_scaling),
                               inv_frequencies(16, want_cfg.rope_theta, want_cfg.rope_scaling), rtol=1e-6, atol=0)
    tok = load_tokenizer(hf)
    prompts = [tok.encode(t) for t in ("The quick brown fox", "What is 2 + 2?", "Hello, world!")]
    with LLM(str(tmp_path / "l3.gguf")) as llm:
        ours = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
            use_tqdm=False)]
    ok, ties, msg = compare_greedy(ours, hf_greedy(hf, prompts, 16))
    assert ok, msg


# last: gguf's reader runs beside the tests above
def test_the_header_reads_as_ggufs_own_reader_reads_it(q4_1, ggufs_own_header):
    ours = read_gguf(q4_1)
    for key, value in ggufs_own_header["fields"].items():
        want = StringArray(value["strings"]) if isinstance(value, dict) else value
        assert ours.metadata[key] == want, key
        if isinstance(value, dict):
            assert "\n".join(ours.strings(key)) == value["text"], key
    assert [list(t) for t in ggufs_own_header["tensors"]] == \
        [[t.name, t.offset, t.num_bytes] for t in ours.tensors.values()]
