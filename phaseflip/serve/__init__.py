"""The OpenAI-compatible HTTP server (`phaseflip serve`) over the AsyncLLM."""
