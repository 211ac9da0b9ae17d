"""GRPO on image prompts through ``megarl train`` (issue 58): ``configs/grpo_tiny_vl_cpu.yaml`` on a
tiny random Qwen2.5-VL and the colour task (``megarl.data.colour_task``: one or two solid images
a prompt), vLLM colocated.

Two real runs of 2 steps: the vision tower trainable at 2 ranks (actor TP 2, vLLM TP 2), and
frozen (``actor.freeze_vision_tower=true``) at 1 rank. Every step's rollout comes from vLLM
holding the actor's weights, tower included (``rollout/logprob_diff_max`` over the image
prompts' responses, after each sync); the final save's HF export (the hub layout,
``visual.*`` beside the language model) holds a tower that moved, or that is bit-identical to
the checkpoint's when frozen, and a language model that moved in both.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._run_outputs import read_metrics

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "grpo_tiny_vl_cpu.yaml"
STEPS = 2
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.multirank]
ONE_RANK = ("trainer.n_gpus_per_node=1",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1")  # fmt: skip


def _train(tmp: Path, name: str, *overrides: str) -> Path:
    run_dir = tmp / "runs" / name
    (tmp / "tmp").mkdir(exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "megarl.cli", "train", "-c", str(CONFIG),
         f"actor_rollout_ref.model.path={tmp / 'model'}",
         f"data.train_files={tmp / 'data' / 'train.parquet'}",
         f"data.val_files={tmp / 'data' / 'test.parquet'}",
         f"trainer.total_training_steps={STEPS}", f"trainer.save_freq={STEPS}",
         f"trainer.default_local_dir={run_dir}", *overrides],
        cwd=REPO, env={**os.environ, "TMPDIR": str(tmp / "tmp")},
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megarl.data.colour_task import write_colour_task
    from megarl.models.tiny_vl import make_tiny_vl_model

    tmp = tmp_path_factory.mktemp("vl_run")
    make_tiny_vl_model(tmp / "model", "qwen2_5_vl", seed=5)
    write_colour_task(tmp / "data", train_size=16, test_size=4)
    trainable = _train(tmp, "trainable")
    frozen = _train(tmp, "frozen", "actor_rollout_ref.actor.freeze_vision_tower=true", *ONE_RANK)
    return {"model": tmp / "model", "trainable": trainable, "frozen": frozen}


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory, under the hub layout's names (``visual.*``,
    ``model.layers.*``; transformers 5's ``model.visual`` / ``model.language_model`` mapped)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        for name, tensor in load_file(f).items():
            name = name.replace("model.visual.", "visual.").replace(
                "model.language_model.", "model."
            )
            out[name] = tensor
    return out


def _export(run_dir: Path) -> dict[str, torch.Tensor]:
    return _weights(run_dir / f"global_step_{STEPS}" / "actor" / "huggingface")


@pytest.mark.parametrize("name", ["trainable", "frozen"])
def test_vllm_follows_the_actor_on_image_prompts(runs, name):
    metrics = read_metrics(runs[name])
    diffs = [metrics[s]["rollout/logprob_diff_max"] for s in range(1, STEPS + 1)]
    print(f"{name}: rollout/logprob_diff_max per step {diffs}")
    assert max(diffs) <= 1e-4, diffs


@pytest.mark.parametrize("name", ["trainable", "frozen"])
def test_the_tower_trains_unless_frozen(runs, name):
    start, end = _weights(runs["model"]), _export(runs[name])
    assert set(end) == set(start)
    tower = [n for n in start if n.startswith("visual.")]
    language = [n for n in start if not n.startswith("visual.")]
    assert tower and language
    moved = {n: float((end[n] - start[n]).abs().max()) for n in start}
    if name == "frozen":
        assert all(moved[n] == 0.0 for n in tower), [n for n in tower if moved[n]]
    else:
        assert all(moved[n] > 0.0 for n in tower), [n for n in tower if not moved[n]]
    assert all(moved[n] > 0.0 for n in language), [n for n in language if not moved[n]]
