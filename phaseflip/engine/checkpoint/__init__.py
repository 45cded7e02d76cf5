"""Checkpoints: an HF-format directory read and validated (loader.py), its tokenizer (tokenizer.py),
the embedded default model (default_model.py) and the one-time GGUF conversion (gguf_convert.py)."""
