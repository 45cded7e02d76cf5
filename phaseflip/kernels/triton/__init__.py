"""The Triton kernels the CUDA path runs (norms, rotary, SiLU-and-mul, the KV store, paged attention);
imported at the first CUDA call, never at import (kernels/dispatch.py)."""
