"""Fixtures of the reliability suite: the tiny Llama and its single-rank greedy reference."""
from __future__ import annotations

import pytest
import torch

from phaseflip import LLM
from tests.reliability.support import ENGINE, greedy, ids


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads; on a busy 2-core machine they only spin."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="session")
def reference(model):
    """reference(prompts, max_tokens) -> greedy token ids of a single-rank, unpressured engine
    (ignore_eos, so every list has max_tokens ids unless max_model_len ends it)."""
    cache: dict[tuple, list[int]] = {}
    with LLM(model=model, **ENGINE) as llm:
        def run(prompts, max_tokens: int) -> list[list[int]]:
            todo = [p for p in prompts if (tuple(p), max_tokens) not in cache]
            for p, out in zip(todo, ids(llm.generate(todo, greedy(max_tokens), use_tqdm=False)) if todo else []):
                cache[(tuple(p), max_tokens)] = out
            return [cache[(tuple(p), max_tokens)] for p in prompts]
        yield run
