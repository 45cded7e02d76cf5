"""The benchmark's workloads, identical token for token for the engine and for HF transformers.

Owns: building (deterministically, from a seed) the offline batch of mixed prompt lengths and output
lengths, the shared-prefix batch (what prefix caching is for) and the single-stream prompt, as plain
token-id lists that can travel as JSON to a subprocess.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass

_WORDS = ("the river city light morning old story engine small green house market road bright winter "
          "people music garden paper window quiet station teacher mountain letter summer bread stone "
          "table evening friend harbor village clock forest ladder silver ocean thunder lantern").split()


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]       # prompt token ids
    max_tokens: list[int]          # output tokens per prompt (EOS ignored, so exactly these many)

    def __post_init__(self):
        if len(self.prompts) != len(self.max_tokens):
            raise ValueError(f"{len(self.prompts)} prompts but {len(self.max_tokens)} max_tokens")

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    def to_json(self) -> dict:
        return asdict(self)


def _text_tokens(tokenizer, rng: random.Random, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        words = " ".join(rng.choice(_WORDS) for _ in range(64))
        ids += tokenizer.encode(words.capitalize() + ". ")
    return ids[:n]


def offline_workload(tokenizer, num_prompts: int = 64, prompt_len: tuple[int, int] = (16, 512),
                     max_tokens: tuple[int, int] = (16, 128), seed: int = 0) -> Workload:
    """num_prompts prompts of uniform random length in prompt_len, output lengths in max_tokens."""
    for name, (lo, hi) in (("prompt_len", prompt_len), ("max_tokens", max_tokens)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name}={lo, hi} is invalid: need 1 <= low <= high")
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} is invalid: must be >= 1")
    rng = random.Random(seed)
    lens = [rng.randint(*prompt_len) for _ in range(num_prompts)]
    outs = [rng.randint(*max_tokens) for _ in range(num_prompts)]
    return Workload([_text_tokens(tokenizer, rng, n) for n in lens], outs)


def single_stream_workload(tokenizer, prompt_len: int = 128, max_tokens: int = 64, seed: int = 1) -> Workload:
    return Workload([_text_tokens(tokenizer, random.Random(seed), prompt_len)], [max_tokens])


def shared_prefix_workload(tokenizer, num_chats: int = 32, system_len: int = 400, num_docs: int = 4,
                           doc_len: int = 400, questions_per_doc: int = 8, question_len: tuple[int, int] = (12, 40),
                           max_tokens: int = 16, seed: int = 2) -> Workload:
    """num_chats requests sharing one system prompt, and num_docs documents asked questions_per_doc
    questions each (the document first, then the question), shuffled together as a batch arrives."""
    rng = random.Random(seed)
    system = _text_tokens(tokenizer, rng, system_len)
    docs = [_text_tokens(tokenizer, rng, doc_len) for _ in range(num_docs)]
    prompts = [system + _text_tokens(tokenizer, rng, rng.randint(*question_len)) for _ in range(num_chats)]
    prompts += [doc + _text_tokens(tokenizer, rng, rng.randint(*question_len))
                for doc in docs for _ in range(questions_per_doc)]
    rng.shuffle(prompts)
    return Workload(prompts, [max_tokens] * len(prompts))
