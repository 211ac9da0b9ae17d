"""verl's own Megatron example scripts (the dense ones, Qwen3-30B-A3B's MoE one, verl-recipe's
DAPO, verl 0.9's one-step-off and fully-async recipes, its on-policy distillation one), their override lists unchanged
(tests/config/verl_examples/: only model paths, the MoE script's distributed checkpoint and data
files replaced by tiny local ones), validate with ``megarl config validate`` on verl's defaults
(no config file, as verl's ``--config-name=ppo_megatron_trainer``), except the features
megarl does not have yet (:data:`REFUSED`), each refused in exactly one line naming its key;
one GRPO and one PPO list, with the layout and batch sizes reduced to two CPU ranks, train two
steps through ``megarl train``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from megarl import cli
from tests.conftest import REPO

EXAMPLES = Path(__file__).parent / "verl_examples"
SCRIPTS = sorted(p.stem for p in EXAMPLES.glob("*.txt"))
_OTC = "actor_rollout_ref.actor.megatron.override_transformer_config"
REFUSED = {
    "fully_async_grpo_qwen3moe-30b-a3b_math_megatron_96_32": [
        "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=True",
        # Megatron's flex dispatcher (DeepEP): accepted where deep_ep imports (a GPU stack)
        *(
            ()
            if find_spec("deep_ep")
            else (
                f"{_OTC}.moe_token_dispatcher_type=flex: the flex dispatcher needs DeepEP",
                f"{_OTC}.moe_enable_deepep=true: the flex dispatcher needs DeepEP",
            )
        ),
    ],
    # TP 4 x PP 2 x EP 4 with expert TP = TP (Megatron's default, verl passes null) is 32 ranks
    # of experts on the script's default 8 GPUs: Megatron's initialize_model_parallel refuses it too
    "grpo_qwen3moe-30b-a3b_vllm_megatron": [
        (
            "world size 8 (trainer.nnodes × trainer.n_gpus_per_node) is not divisible by "
            "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size (null: TP) × "
            "pipeline_model_parallel_size × expert_model_parallel_size = 4 × 2 × 4 = 32"
        ),
    ],
}
"""Script -> the refusals it gets (the start of each line): features megarl does not have yet."""
# Two CPU ranks instead of 8 or 16 GPUs, a tiny batch and short responses; nothing else changes.
TWO_RANKS = {
    "trainer.device": "cpu",  # verl's default is cuda: refused by megarl train without a GPU
    "actor_rollout_ref.actor.megatron.sequence_parallel": "false",  # the CPU layer spec's limit
    "trainer.n_gpus_per_node": "2",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": "1",
    "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size": "1",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "2",
    "data.train_batch_size": "4",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "2",
    "actor_rollout_ref.rollout.n": "2",
    "data.max_prompt_length": "64",
    "data.max_response_length": "16",
    "actor_rollout_ref.rollout.name": "actor",  # the trainer's own sampler: no vLLM start here
    "trainer.total_training_steps": "2",
    "trainer.test_freq": "-1",
    "data.val_max_samples": "8",  # verl validates before training: 8 prompts, not all 512
    "trainer.logger": "['console']",
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    from megarl.commands import data
    from megarl.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("verl_examples")
    for family in ("qwen2", "llama"):
        make_tiny_model(root / family, family=family)
    # Qwen3-30B-A3B's stand-in: 4 KV heads (the example's TP 4 splits them), 8 experts (EP 4),
    # and the Megatron distributed checkpoint the script converts it to first.
    make_tiny_model(root / "qwen3_moe", family="qwen3_moe", num_key_value_heads=4)
    assert cli.main(["convert", "hf-to-megatron", "--hf-path", str(root / "qwen3_moe"),
                     "--out", str(root / "qwen3_moe_mcore")]) == 0  # fmt: skip
    assert data.main(["synth", "--out", str(root / "data"), "--train-size", "64"]) == 0
    train, val = root / "data" / "train.parquet", root / "data" / "test.parquet"
    return {"train": f"['{train}', '{train}']", "val": f"['{val}', '{val}']", "root": str(root)}


def overrides(script: str, files: dict[str, str]) -> list[str]:
    root = Path(files["root"])
    family = "llama" if "deepseek" in script else "qwen3_moe" if "moe" in script else "qwen2"
    model = root / family
    text = (EXAMPLES / f"{script}.txt").read_text()
    text = text.format(
        model=model, critic=model, teacher=model, train=files["train"], val=files["val"],
        dist_ckpt=root / f"{family}_mcore",
    )  # fmt: skip
    return text.splitlines()


@pytest.mark.parametrize("script", SCRIPTS)
def test_verls_example_overrides_validate_unchanged(script, files, capsys):
    code = cli.main(["config", "validate", *overrides(script, files)])
    out, err = capsys.readouterr()
    if script not in REFUSED:
        assert code == 0, err
        assert out.startswith("ok: ") and "error" not in err, (out, err)
        return
    assert code == 2 and not out, (out, err)
    first, *rest = err.strip().splitlines()
    lines = [line.strip().removeprefix("- ") for line in rest] if rest else [first]
    lines = [line.removeprefix("error: ") for line in lines]
    expected = REFUSED[script]
    assert len(lines) == len(expected), err  # one line per refusal, nothing else
    for start in expected:
        assert sum(line.startswith(start) for line in lines) == 1, (start, err)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize(
    "script", ["grpo_qwen2-7b_math_megatron", "ppo_qwen2-7b_math_gsm8k_megatron"]
)
def test_a_verl_example_trains_two_steps_on_two_ranks(script, files, tmp_path):
    reduced = {**dict(o.split("=", 1) for o in overrides(script, files)), **TWO_RANKS}
    reduced["trainer.default_local_dir"] = str(tmp_path / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(
        [sys.executable, "-m", "megarl.cli", "train", *(f"{k}={v}" for k, v in reduced.items())],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps = [r["step"] for r in records if "actor/pg_loss" in r["metrics"]]
    assert steps == [1, 2], records
    assert "val/score/mean" in records[0]["metrics"] and records[0]["step"] == 0, records[0]
    if script.startswith("ppo"):
        assert all("critic/vf_loss" in r["metrics"] for r in records if r["step"] in steps)


def test_verls_default_device_without_a_gpu_is_refused_before_launch(files):
    """verl's default trainer.device=cuda validates for a cluster (``config validate``), but
    ``megarl train`` on a machine without CUDA refuses it in its pre-flight instead of crashing
    in every rank (the CPU layer spec refuses verl's default sequence parallelism)."""
    import torch

    from megarl.commands.train import preflight

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    problem, _, _ = preflight([], overrides("grpo_qwen2-7b_math_megatron", files))
    assert problem and problem.startswith("trainer.device=cuda (verl's default)"), problem
