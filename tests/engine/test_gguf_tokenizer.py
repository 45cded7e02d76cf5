"""A GGUF file's byte-level BPE tokenizer built from its metadata (engine/checkpoint/gguf_tokenizer.py)
against transformers' GGUF converter on the same file: the same tokenizer.json and the same ids, for the
plain GPT-2 split and the named ones, with and without the BOS the file asks for; what it does not build
goes to that converter. (The shipped SmolLM2 file against the checkpoint converted from it:
test_gguf_model.py.)"""
import json

import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package (a dependency) is not installed")

from phaseflip.engine.checkpoint import gguf_model, gguf_tokenizer  # noqa: E402
from phaseflip.engine.checkpoint.gguf_file import read_gguf  # noqa: E402
from phaseflip.engine.checkpoint.tokenizer import Tokenizer, load_tokenizer  # noqa: E402
from tests.models import CHATML_TEMPLATE, SPECIAL_TOKENS, make_tokenizer  # noqa: E402

TEXTS = ("Hello world 12345 6789 0.5", "  two spaces\n\nnewlines\t tabs  ", "café naïve 日本語 🙂 ß",
         "<|im_start|>user\nhi<|im_end|>\n<think>why</think><tool_call>", "don't I'll WE'RE they've",
         "def f(x):\n    return x**2  # comment", "")
THINK = "<think>"   # a token the file marks user-defined: matched whole, not special
TOOL = "<tool_call>"   # one it marks control, not BOS / EOS / PAD: a special token all the same


def _vocabulary_file(tmp_path, pre: str | None, add_bos: bool, model: str = "gpt2"):
    """A GGUF of the test tokenizer's vocabulary and merges (nothing else), as llama.cpp's converter
    writes one: the special tokens and one more marked control, one token user-defined."""
    source = json.loads((make_tokenizer(tmp_path / "source") / "tokenizer.json").read_text())
    vocab = source["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get) + [TOOL, THINK]
    merges = [" ".join(m) if isinstance(m, list) else m for m in source["model"]["merges"]]
    types = [3 if t in (*SPECIAL_TOKENS, TOOL) else 4 if t == THINK else 1 for t in tokens]
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(4096)
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHATML_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre,add_bos", [("smollm", False), ("qwen2", True), ("llama-bpe", False), (None, True)])
def test_the_tokenizer_is_transformers_own_from_the_same_file(tmp_path, pre, add_bos):
    transformers = pytest.importorskip("transformers", reason="the reference (transformers) is not installed")
    path = _vocabulary_file(tmp_path, pre, add_bos)
    assert gguf_tokenizer.reads_vocabulary(read_gguf(path))
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    tok = load_tokenizer(path)
    assert json.loads((tok_dir := gguf_model.gguf_tokenizer_dir(path, tmp_path / "cache")).joinpath(
        "tokenizer.json").read_text()) == json.loads(reference.backend_tokenizer.to_str())
    for text in TEXTS:
        assert tok.encode(text) == reference(text)["input_ids"], text
    assert tok.encode("hi")[0] == tok.bos_token_id if add_bos else tok.encode("hi")[0] != tok.bos_token_id
    assert tok.encode(THINK, add_special_tokens=False) == [len(tok) - 1]
    assert tok.encode(TOOL, add_special_tokens=False) == [len(tok) - 2]
    assert tok.decode(tok.encode(TEXTS[3]), skip_special_tokens=True) == "user\nhi\n<think>why</think>"
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    assert Tokenizer(tok_dir).apply_chat_template([{"role": "user", "content": "hi"}]) == \
        reference.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_a_vocabulary_it_does_not_build_goes_to_transformers_converter(tmp_path, monkeypatch):
    """A sentencepiece vocabulary, or a split this module does not name: transformers' converter."""
    converted = []
    monkeypatch.setattr(gguf_model, "_convert_tokenizer",
                        lambda path, file, out: converted.append(file.metadata.get("tokenizer.ggml.pre")) or
                        (out / "tokenizer.json").write_text("{}"))
    for pre, model in (("default", "llama"), ("a-split-not-named-here", "gpt2")):
        path = _vocabulary_file(tmp_path / pre, pre, False, model=model)
        assert not gguf_tokenizer.reads_vocabulary(read_gguf(path))
        gguf_model.gguf_tokenizer_dir(path, tmp_path / "cache")
    assert converted == ["default", "a-split-not-named-here"]
