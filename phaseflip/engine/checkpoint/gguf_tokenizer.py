"""A GGUF file's byte-level BPE tokenizer, built from its metadata with the `tokenizers` library.

Owns: `reads_vocabulary` (whether this module builds the file's tokenizer) and `write_tokenizer`
(tokenizer.json, tokenizer_config.json and chat_template.jinja into a directory, the files
checkpoint/tokenizer.py reads). It builds what transformers' GGUF converter builds from the same keys, so
that a file and the checkpoint converted from it tokenize alike: the vocabulary (a token outside the
byte alphabet spelled by its UTF-8 bytes), the merges, the split its `tokenizer.ggml.pre` names (GPT-2's
for the plain ones), the tokens marked control as special tokens and those marked user-defined as added
ones, BOS / EOS added where the file says so, the special tokens' texts, the context length and the chat
template. It covers `tokenizer.ggml.model` "gpt2" (SmolLM2, Qwen2 / 2.5 / 3, Llama 3, Mistral's Tekken);
a sentencepiece vocabulary ("llama": Llama 2, Mistral 7B v0.1-0.3) or a split not named here is left to
transformers' converter (gguf_model.gguf_tokenizer_dir).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from phaseflip.engine.checkpoint.gguf_file import GGUFFile

CONTROL, USER_DEFINED = 3, 4    # tokenizer.ggml.token_type values

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split its merges were learned on; None: GPT-2's own (ByteLevel's regex)
SPLITS = {None: None, "default": None, "gpt2": None, "gpt-2": None, "smollm": None,
          "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
          "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "tekken": _TEKKEN_SPLIT}


def reads_vocabulary(file: GGUFFile) -> bool:
    """Whether write_tokenizer builds this file's tokenizer: a byte-level BPE vocabulary with merges and
    a split this module knows."""
    meta = file.metadata
    return (meta.get("tokenizer.ggml.model") == "gpt2" and "tokenizer.ggml.merges" in meta
            and meta.get("tokenizer.ggml.pre") in SPLITS)


def write_tokenizer(file: GGUFFile, out_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json (and chat_template.jinja where the file has a template)."""
    meta = file.metadata
    tokens = file.strings("tokenizer.ggml.tokens")
    backend = _backend(tokens, file.strings("tokenizer.ggml.merges"), meta.get("tokenizer.ggml.token_type") or (),
                       SPLITS[meta.get("tokenizer.ggml.pre")])
    specials = {name: tokens[meta[key]] for name, key in _SPECIAL_IDS.items() if meta.get(key) is not None}
    _add_special(backend, specials, bool(meta.get("tokenizer.ggml.add_bos_token")),
                 bool(meta.get("tokenizer.ggml.add_eos_token")))
    config = {**specials, "tokenizer_class": "PreTrainedTokenizerFast"}
    max_length = meta.get(f"{meta.get('general.architecture')}.context_length")
    if max_length is not None:
        config["model_max_length"] = int(max_length)
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
        (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
    backend.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                  encoding="utf-8")


_SPECIAL_IDS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte: printable Latin-1 bytes stand for themselves, the others
    take the characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _spelled(token: str, alphabet: set[str], spelling: dict[int, str]) -> str:
    return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))


def _backend(tokens: list[str], merges: list[str], token_types, split: str | None):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {_spelled(t, alphabet, spelling): i for i, t in enumerate(tokens)}
    backend = Tokenizer(BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                            continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else
                             pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                      pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                               use_regex=False)]))
    backend.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, token_types))
    # a control token outside the byte alphabet is a mislabel (no byte-level text spells it): not added
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, kind in typed
                                if kind == CONTROL and set(t) <= alphabet])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t, kind in typed
                        if kind == USER_DEFINED and t in vocab])
    return backend


def _add_special(backend, specials: dict[str, str], add_bos: bool, add_eos: bool) -> None:
    """The special tokens' texts ({"bos_token": text, ...}) as special tokens, and the template that puts
    BOS / EOS around a text where the file asks for them."""
    from tokenizers import AddedToken, processors
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials.values()])
    bos, eos = specials.get("bos_token") if add_bos else None, specials.get("eos_token") if add_eos else None
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
    specials = [(t, backend.token_to_id(t)) for t in (bos, eos) if t]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
