"""The OpenAI request bodies `phaseflip serve` accepts, as pydantic models, and their SamplingParams.

Owns: which fields a completion or chat request may carry, their types, and the translation of a
request into the engine's SamplingParams. A field this server does not implement is refused with an
error naming it, never ignored: an unknown field by pydantic (extra="forbid"), a known OpenAI field
with an unimplemented value (tools, a response_format other than text, best_of > 1, suffix) by a
validator here. A field a request leaves unset takes the model's generation_config.json default where
it has one. The values' ranges are SamplingParams' to check (one authority for the offline API and the
server).
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from phaseflip.engine.checkpoint.generation_config import GenerationDefaults
from phaseflip.engine.sampling_params import SamplingParams


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM's: with include_usage, each chunk carries its choice's usage


class _Sampling(Strict):
    """The fields completions and chat share (OpenAI's, and vLLM's extra sampling fields)."""
    model: str | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream=true")
        return v

    def _params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                defaults: GenerationDefaults | None = None, max_tokens_fields: tuple[str, ...] = ()) -> SamplingParams:
        """SamplingParams of this request; a field the request leaves unset takes the model's
        generation_config.json default where it has one (vLLM's behaviour)."""
        given = dict(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, truncate_prompt_tokens=self.truncate_prompt_tokens,
            bad_words=self.bad_words)
        if defaults is not None:
            named = set(self.model_fields_set)
            if named & set(max_tokens_fields):
                named.add("max_tokens")
            given = defaults.fill(given, named)
        return SamplingParams(**given)

    def field_of(self, engine_name: str) -> str:
        """The field of this request that set the engine's sampling value `engine_name`."""
        return engine_name

    def max_tokens_named(self) -> str | None:
        """The field by which the request itself set how many tokens to generate (None: a default did)."""
        return "max_tokens" if "max_tokens" in self.model_fields_set else None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


def _refuse(field: str, value, why: str):
    raise ValueError(f"{field}={value!r} is not supported: {why}")


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("best_of")
    @classmethod
    def _one_best_of(cls, v):
        if v is not None and v != 1:
            _refuse("best_of", v, "phaseflip returns every sample it draws (use n)")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v is not None:
            _refuse("suffix", v, "phaseflip does not implement insertion (fill in the middle)")
        return v

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, v):
        if not v:
            raise ValueError("the prompt is empty: give a str, a list of str or token ids")
        return v

    def prompts(self) -> list:
        """The prompts of this request: a list of str or of token-id lists."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens=0: the prompt alone comes back (with its logprobs when asked: how scorers
        such as lm-eval's loglikelihood use the API). The engine then generates one token nobody sees."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, defaults: GenerationDefaults | None = None) -> SamplingParams:
        """echo with logprobs: the echoed prompt's tokens carry theirs too (the prompt's logprobs)."""
        return self._params(1 if self.echo_only else self.max_tokens, self.logprobs,
                            self.logprobs if self.echo else None, defaults, ("max_tokens",))


class ContentPart(Strict):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            _refuse("content part type", self.type, "phaseflip serves text models (only 'text' parts)")
        if self.text is None:
            raise ValueError("a 'text' content part needs its 'text'")
        return self


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None

    def as_template_message(self) -> dict:
        """The message as the tokenizer's apply_chat_template takes it (which joins text parts by newlines,
        as vLLM does), `name` passed on where given (templates that know it use it)."""
        content = self.content
        if isinstance(content, list):
            content = [part.model_dump(exclude_none=True) for part in content]
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ResponseFormat(Strict):
    type: str

    @field_validator("type")
    @classmethod
    def _text(cls, v):
        if v != "text":
            _refuse("response_format.type", v, "phaseflip has no constrained decoding (only 'text')")
        return v


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    add_generation_prompt: bool = True

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v):
        if v:
            _refuse("tools", "[...]", "phaseflip does not implement tool calling")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, v):
        if v not in (None, "none"):
            _refuse("tool_choice", v, "phaseflip does not implement tool calling")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return v

    def field_of(self, engine_name: str) -> str:
        """The field of this request that set the engine's sampling value `engine_name`."""
        if engine_name == "logprobs":
            return "top_logprobs"
        if engine_name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return engine_name

    def max_tokens_named(self) -> str | None:
        if "max_completion_tokens" in self.model_fields_set:
            return "max_completion_tokens"
        return super().max_tokens_named()

    def sampling_params(self, defaults: GenerationDefaults | None = None) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, None, defaults,
                            ("max_tokens", "max_completion_tokens"))
