"""phaseflip: a graph-capture-first LLM inference engine (PP for prefill, TP for decode).

The public names are imported lazily so that `import phaseflip.engine.blocks` (plain Python) never
pulls in torch.
"""

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name):
    if name == "LLM":
        from phaseflip.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from phaseflip.engine.sampling_params import SamplingParams
        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from phaseflip.engine import requests
        return getattr(requests, name)
    raise AttributeError(f"module 'phaseflip' has no attribute {name!r}")
