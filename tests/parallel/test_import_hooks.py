"""megarl's import hooks (megarl/parallel/import_hooks.py), in a fresh interpreter: without CUDA
Megatron's JIT fuser is the identity (Inductor never imported), loading a tokenizer leaves
scikit-learn unimported, Megatron's model code leaves wandb unimported (no temporary
directories behind a rank), and transformers' object-detection losses and vLLM's audio helpers
leave SciPy's optimize and signal unimported, while all stay importable and the deferred SciPy
functions are SciPy's own when called."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

PROBE = """
import sys, torch
import megarl
import megatron.core
from megatron.core import jit
from transformers import AutoTokenizer  # noqa: F401 (imports transformers.generation)
import transformers.generation.candidate_generator
print("fuser", jit.jit_fuser.__name__, "cuda", torch.cuda.is_available())
print("inductor", "torch._inductor.compile_fx" in sys.modules)
print("sklearn", "sklearn" in sys.modules)
import transformers.loss.loss_utils  # noqa: F401 (every object-detection loss)
import vllm.multimodal.audio as audio  # imported by vllm.sampling_params
print("scipy", [m for m in ("scipy.optimize", "scipy.signal") if m in sys.modules])
import sklearn.metrics  # noqa: F401
print("sklearn importable")
import megarl.trainer.setup  # noqa: F401 (Megatron's GPT model, optimizer, inference engine)
import megatron.core.timers
print("wandb", "wandb" in sys.modules, megatron.core.timers.wandb)
import wandb  # noqa: F401
print("wandb importable")
from transformers.loss import loss_for_object_detection as detection
rows, cols = detection.linear_sum_assignment([[4.0, 1.0], [2.0, 0.0]])
print("assignment", rows.tolist(), cols.tolist())
import scipy.signal
print("resample is scipy's", audio.scipy_signal.resample_poly is scipy.signal.resample_poly)
"""


def test_no_fuser_compile_no_sklearn_no_wandb_and_no_scipy_import_without_cuda():
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    if "cuda True" in lines[0]:
        assert lines[0] == "fuser compile cuda True"  # with CUDA Megatron keeps torch.compile
    else:
        assert lines[0] == "fuser noop_decorator cuda False"
        assert lines[1] == "inductor False"
    assert lines[2:] == [
        "sklearn False", "scipy []", "sklearn importable", "wandb False None",
        "wandb importable", "assignment [0, 1] [1, 0]", "resample is scipy's True",
    ]  # fmt: skip


TE_PROBE = """
import os, sys
sys.path.insert(0, sys.argv[1])
import megarl
import transformer_engine
print(os.environ.get("CUDA_PATH"))
"""


def test_transformer_engine_finds_the_cuda_13_wheels_when_cuda_path_is_unset(tmp_path):
    """A stand-in ``transformer_engine`` package (TE needs CUDA to install) beside pip's
    ``nvidia/cu13/lib``: importing it through megarl sets ``CUDA_PATH`` to that folder when
    unset, keeps one that is set, and sets none without the folder."""
    (tmp_path / "transformer_engine").mkdir()
    (tmp_path / "transformer_engine" / "__init__.py").write_text("")
    env = {k: v for k, v in __import__("os").environ.items() if k != "CUDA_PATH"}

    def imported(**extra: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", TE_PROBE, str(tmp_path)], cwd=REPO, env={**env, **extra},
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip()

    assert imported() == "None"
    (tmp_path / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    assert imported() == str(tmp_path / "nvidia" / "cu13")
    assert imported(CUDA_PATH="/opt/cuda") == "/opt/cuda"
