"""The tokenizer of an HF-format model directory: tokenizer.json + tokenizer_config.json + chat template.

Owns: encode/decode with the `tokenizers` library (special tokens added exactly as HF does from
tokenizer.json's post-processor) and chat-template rendering with a sandboxed jinja2 environment, as
transformers does. It never imports transformers, but answers the calls vLLM users make on
`llm.get_tokenizer()` (an HF tokenizer there): `tok(text)`, `len(tok)`, `batch_decode`,
`convert_ids_to_tokens`, the special tokens' texts and ids, `apply_chat_template(..., tokenize=...)`.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

from phaseflip.engine.checkpoint.loader import CheckpointError, read_json

class Tokenizer:
    """tokenizer.json through the `tokenizers` library, with HF's special-token and chat-template rules."""

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as _Backend  # deferred: keeps `import loader` cheap
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: file not found")
        try:
            self._backend = _Backend.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exception on bad JSON
            raise CheckpointError(f"{path}: unreadable tokenizer ({e})") from e
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = read_json(cfg_path) if cfg_path.is_file() else {}
        smap_path = model_dir / "special_tokens_map.json"
        smap = read_json(smap_path) if smap_path.is_file() else {}
        self.special_tokens = {key: tok for key in ("bos_token", "eos_token", "unk_token", "pad_token")
                               if (tok := _token_text(cfg.get(key, smap.get(key)))) is not None}
        self.bos_token_id = self._id_of("bos_token")
        self.eos_token_id = self._id_of("eos_token")
        self._clean_up_spaces = bool(cfg.get("clean_up_tokenization_spaces", False)) and \
            type(self._backend.model).__name__ != "BPE"  # HF skips the clean-up for BPE models
        # tokenizer.json's post-processor alone decides which special tokens encode() adds: transformers 5
        # ignores tokenizer_config.json's add_bos_token/add_eos_token whenever tokenizer.json exists.
        self._chat_template = _chat_template(model_dir, cfg)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, added tokens included (HF's len(tokenizer))."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        ids = {i for i, tok in self._backend.get_added_tokens_decoder().items() if tok.special}
        ids.update(i for i in (self._id_of(k) for k in self.special_tokens) if i is not None)
        return sorted(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    # -- HF's calls on a tokenizer ------------------------------------------------------------------
    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict:
        """{"input_ids": ids} (a list of id lists for a list of texts), as HF's tokenizer(text)."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}

    def __len__(self) -> int:
        return self.vocab_size

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str | None] | None:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        return [self._backend.id_to_token(i) for i in ids]

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of("pad_token")

    # -- chat ---------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            tokenize: bool = False, continue_final_message: bool = False, tools=None,
                            chat_template: str | None = None, **template_kwargs) -> str | list[int]:
        """The conversation rendered by its template (or `chat_template`): text, or ids with tokenize=True
        (HF's parameters; the text is the default here). A message's content may be a list of OpenAI
        parts: their texts are joined by newlines, as vLLM joins them. continue_final_message: the text
        ends with the last message's content, open for the model to go on (no end of turn)."""
        source = chat_template if chat_template is not None else self._chat_template
        if source is None:
            raise ValueError("this tokenizer has no chat template (neither chat_template.jinja nor "
                             "tokenizer_config.json 'chat_template'); pass a plain prompt instead")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True continues the last message: it cannot also add a "
                             "generation prompt (pass add_generation_prompt=False)")
        messages = [_template_message(m) for m in messages]
        text = _compile_template(source).render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **template_kwargs})
        if continue_final_message:
            text = _open_final_message(text, messages[-1].get("content", ""))
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **template_options) -> tuple[str, list[int]]:
        """A conversation's prompt: the rendered template and its token ids (the template writes the
        special tokens itself, so none are added). template_options: apply_chat_template's."""
        text = self.apply_chat_template(messages, add_generation_prompt, **template_options)
        return text, self.encode(text, add_special_tokens=False)

    def _id_of(self, key: str) -> int | None:
        tok = self.special_tokens.get(key)
        return None if tok is None else self._backend.token_to_id(tok)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of an HF-format directory, or of a GGUF file (gguf_model.gguf_tokenizer_dir)."""
    from phaseflip.cache import cache_dir
    from phaseflip.engine.checkpoint import gguf_model
    if gguf_model.is_gguf(model_dir):
        return Tokenizer(gguf_model.gguf_tokenizer_dir(model_dir, cache_dir()))
    return Tokenizer(model_dir)


def _template_message(message: dict) -> dict:
    """The message as templates take it: None fields dropped, a list of text parts joined by newlines."""
    out = {k: v for k, v in message.items() if v is not None}
    if isinstance(out.get("content"), list):
        parts = out["content"]
        kinds = sorted({p.get("type") for p in parts if p.get("type") != "text"})
        if kinds:
            raise ValueError(f"message content parts of type {kinds} are not served: only 'text' parts")
        out["content"] = "\n".join(p.get("text") or "" for p in parts)
    return out


def _open_final_message(text: str, final: str) -> str:
    """The rendered text cut right after the last message's content (what follows closes its turn)."""
    final = final.strip()
    at = text.rfind(final) if final else -1
    if at < 0:
        raise ValueError("continue_final_message: the template's text does not contain the last message's "
                         "content, so there is nothing to continue")
    return text[:at + len(final)]


def _token_text(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def _chat_template(model_dir: Path, cfg: dict) -> str | None:
    """chat_template.jinja wins over tokenizer_config.json's "chat_template" (as in transformers 5)."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: the "default" one
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    return template


@functools.lru_cache(maxsize=16)   # a conversation's rendering reuses its template's compiled form
def _compile_template(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _clean_up_tokenization(text: str) -> str:
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text
