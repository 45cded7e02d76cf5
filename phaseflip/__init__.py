"""phaseflip: a graph-capture-first LLM inference engine (PP for prefill, TP for decode).

The public names are imported lazily so that `import phaseflip.engine.blocks` (plain Python) never
pulls in torch.
"""

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "LLM":
        from phaseflip.engine.llm import LLM
        return LLM
    if name == "AsyncLLM":
        from phaseflip.engine.async_llm import AsyncLLM
        return AsyncLLM
    if name == "SamplingParams":
        from phaseflip.engine.sampling_params import SamplingParams
        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from phaseflip.engine import requests
        return getattr(requests, name)
    raise AttributeError(f"module 'phaseflip' has no attribute {name!r}")
