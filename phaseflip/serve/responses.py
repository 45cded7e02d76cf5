"""The OpenAI response bodies `phaseflip serve` sends, as pydantic models, and the views that fill them.

Owns: the shapes of completions, chat completions, their streamed chunks, usage, logprobs, errors and
the model list; and `CompletionView` / `ChatView`, which turn the engine's pieces (RequestOutputs
holding what is new) into those bodies: a whole response from every piece of a request, or one chunk
per piece. Choice i*n + j is sample j of prompt i. `usage` counts each prompt once and every
generated token of every sample (the stop token included, as vLLM counts it).
"""
from __future__ import annotations

import dataclasses
import time

from pydantic import BaseModel

from phaseflip.engine.requests import CompletionOutput


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """A whole completion, or (object the same, usage None until the last) one streamed chunk."""
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "phaseflip"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class _View:
    """What both views share: the request's identity, its prompts, the token texts, usage."""

    def __init__(self, request_id: str, model: str, prepared: list, n: int, tokenizer):
        self.id, self.model, self.prepared, self.n = request_id, model, prepared, n
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self._choice_tokens: dict[int, int] = {}     # choice index -> its generated tokens so far
        self._token_text: dict[int, str] = {}
        self.prompt_logprobs: dict[int, list] = {}   # prompt index -> its tokens' logprobs, where asked

    def note_prompt(self, prompt_index: int, out) -> None:
        """A RequestOutput of prompt_index arrived: keep its prompt's logprobs (complete by its first token)."""
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = out.prompt_logprobs

    def choice_index(self, prompt_index: int, piece: CompletionOutput) -> int:
        return prompt_index * self.n + piece.index

    def count(self, prompt_index: int, pieces: list[CompletionOutput]) -> None:
        """Every piece the engine produced goes through here once, shown in a chunk or not."""
        for p in pieces:
            index = self.choice_index(prompt_index, p)
            self._choice_tokens[index] = self._choice_tokens.get(index, 0) + len(p.token_ids)

    def usage(self) -> Usage:
        prompt = sum(len(p.token_ids) for p in self.prepared)
        done = sum(self._choice_tokens.values())
        return Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)

    def choice_usage(self, prompt_index: int, piece: CompletionOutput) -> Usage:
        """The usage a streamed chunk carries under continuous_usage_stats (vLLM's): its prompt's tokens
        and its choice's generated tokens so far."""
        prompt = len(self.prepared[prompt_index].token_ids)
        done = self._choice_tokens.get(self.choice_index(prompt_index, piece), 0)
        return Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


class CompletionView(_View):
    def __init__(self, request_id, model, prepared, n, tokenizer, echo: bool, echo_only: bool = False):
        """echo_only (echo with max_tokens=0): the one token the engine generated is neither shown nor counted."""
        super().__init__(request_id, model, prepared, n, tokenizer)
        self.echo, self.echo_only = echo, echo_only   # echo_only is echo's own case (CompletionRequest)
        self._echoed: set[int] = set()
        self._offsets: dict[int, int] = {}

    def count(self, prompt_index: int, pieces: list[CompletionOutput]) -> None:
        if not self.echo_only:
            super().count(prompt_index, pieces)

    def choice(self, prompt_index: int, piece: CompletionOutput) -> CompletionChoice:
        if self.echo_only:
            piece = dataclasses.replace(piece, text="", token_ids=[], finish_reason=piece.finish_reason and "length",
                                        logprobs=None if piece.logprobs is None else [])
        index = self.choice_index(prompt_index, piece)
        text = piece.text
        echoed = None
        if self.echo and index not in self._echoed:
            self._echoed.add(index)
            p = self.prepared[prompt_index]
            # token ids echoed with their special tokens: the text the logprobs' tokens and offsets index
            text = (p.prompt if p.prompt is not None
                    else self.tokenizer.decode(p.token_ids, skip_special_tokens=False)) + text
            echoed = p.token_ids
        return CompletionChoice(index=index, text=text, logprobs=self._logprobs(index, piece, prompt_index, echoed),
                                finish_reason=piece.finish_reason, stop_reason=piece.stop_reason)

    def _logprobs(self, index: int, piece: CompletionOutput, prompt_index: int,
                  echoed: list[int] | None) -> CompletionLogprobs | None:
        """The piece's tokens' logprobs, after the echoed prompt's (None for its first token) on the
        choice's first piece with echo."""
        if piece.logprobs is None:
            return None
        ids, entries = list(piece.token_ids), list(piece.logprobs)
        if echoed is not None:
            prompt = self.prompt_logprobs.get(prompt_index) or [None] * len(echoed)
            ids, entries = list(echoed) + ids, list(prompt) + entries
        offset = self._offsets.get(index, 0)
        tokens, offsets = [], []
        for t in ids:
            tokens.append(self.token_text(t))
            offsets.append(offset)
            offset += len(tokens[-1])
        self._offsets[index] = offset
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=[None if d is None else d.get(t) for d, t in zip(entries, ids)],
            top_logprobs=[None if d is None else {self.token_text(k): v for k, v in d.items()} for d in entries],
            text_offset=offsets)

    def chunk(self, prompt_index: int, pieces: list[CompletionOutput]) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model,
                                  choices=[self.choice(prompt_index, p) for p in pieces])

    def usage_chunk(self) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[],
                                  usage=self.usage())

    def response(self, whole: list[list[CompletionOutput]]) -> CompletionResponse:
        """whole[i]: prompt i's samples, each joined from its pieces."""
        for i, samples in enumerate(whole):
            self.count(i, samples)
        choices = [self.choice(i, piece) for i, samples in enumerate(whole) for piece in samples]
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=self.usage())


class ChatView(_View):
    def __init__(self, request_id, model, prepared, n, tokenizer, num_top: int | None):
        super().__init__(request_id, model, prepared, n, tokenizer)
        self.num_top = num_top
        self._started: set[int] = set()

    def _logprobs(self, piece: CompletionOutput) -> ChatLogprobs | None:
        if piece.logprobs is None:
            return None
        return ChatLogprobs(content=[
            TokenLogprob(**self._entry(t, d[t]), top_logprobs=[TopLogprob(**self._entry(k, v))
                                                               for k, v in list(d.items())[:self.num_top]])
            for t, d in zip(piece.token_ids, piece.logprobs)])

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chunk(self, prompt_index: int, pieces: list[CompletionOutput]) -> ChatCompletionChunk:
        choices = []
        for piece in pieces:
            index = self.choice_index(prompt_index, piece)
            role = None if index in self._started else "assistant"
            self._started.add(index)
            choices.append(ChatChunkChoice(index=index, delta=Delta(role=role, content=piece.text),
                                           logprobs=self._logprobs(piece), finish_reason=piece.finish_reason,
                                           stop_reason=piece.stop_reason))
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices)

    def usage_chunk(self) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                   usage=self.usage())

    def response(self, whole: list[list[CompletionOutput]]) -> ChatCompletionResponse:
        choices = []
        for i, samples in enumerate(whole):
            self.count(i, samples)
            for piece in samples:
                choices.append(ChatChoice(index=self.choice_index(i, piece),
                                          message=AssistantMessage(content=piece.text),
                                          logprobs=self._logprobs(piece), finish_reason=piece.finish_reason,
                                          stop_reason=piece.stop_reason))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=self.usage())
