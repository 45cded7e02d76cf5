"""The /tokenize and /detokenize routes of `phaseflip serve` (vLLM's): the served model's tokenizer over HTTP.

Owns: their bodies (a prompt, or chat messages through the model's template, to token ids with their count
and max_model_len; token ids to text) and the two handlers. Neither runs a step of the engine: a client
counts a prompt's tokens, or checks what a template makes of its messages, without queueing behind
generation. A /tokenize body is the completions shape (`prompt`) or the chat shape (`messages`), told
apart by which of the two it has, as vLLM does.
"""
from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, ValidationError, field_validator

from phaseflip.serve.generation import APIError, Served, templated
from phaseflip.serve.protocol import ChatMessage, Strict


class TokenizeCompletion(Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False    # the template writes the special tokens itself
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _ids(cls, v):
        negative = [t for t in v if t < 0]
        if negative:
            raise ValueError(f"token id {negative[0]} is negative")
        return v


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize_body(data) -> TokenizeCompletion | TokenizeChat:
    """The body as the shape its fields name; pydantic's complaints become the 400 every route gives."""
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object with `prompt` or `messages`", "body")
    if ("prompt" in data) == ("messages" in data):
        raise APIError(400, "give exactly one of `prompt` (text) and `messages` (a chat)",
                       "messages" if "messages" in data else "prompt")
    shape = TokenizeChat if "messages" in data else TokenizeCompletion
    try:
        return shape.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


def tokenize(served: Served, body: TokenizeCompletion | TokenizeChat) -> TokenizeResponse:
    served.check_model(body.model)
    tokenizer = served.engine.tokenizer
    if isinstance(body, TokenizeChat):
        text, ids = templated(tokenizer, body.messages, body.add_generation_prompt,
                              continue_final_message=body.continue_final_message)
        if body.add_special_tokens:   # the template wrote its own; these are the tokenizer's on top
            ids = tokenizer.encode(text, add_special_tokens=True)
    else:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=served.engine.llm.plan.max_model_len, tokens=ids,
                            token_strs=strs)


def detokenize(served: Served, body: DetokenizeRequest) -> DetokenizeResponse:
    served.check_model(body.model)
    tokenizer = served.engine.tokenizer
    outside = [t for t in body.tokens if t >= len(tokenizer)]
    if outside:
        raise APIError(400, f"tokens: token id {outside[0]} is outside the vocabulary [0, {len(tokenizer)})",
                       "tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))
