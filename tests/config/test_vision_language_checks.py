"""The pre-flight of a vision-language run (issue 58): ``configs/grpo_tiny_vl_cpu.yaml`` on a tiny
Qwen2.5-VL validates with its paths checked; what a VL actor cannot do yet is refused, each in one
line naming its key (``megarl train`` exits 2 on it); ``actor.freeze_vision_tower`` is accepted
for a VL checkpoint and refused for a text one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config, validate

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "grpo_tiny_vl_cpu.yaml"
A = "actor_rollout_ref.actor.megatron."


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[str]:
    from megarl.data.colour_task import write_colour_task
    from megarl.models.tiny_vl import make_tiny_vl_model

    tmp = tmp_path_factory.mktemp("vl_checks")
    make_tiny_vl_model(tmp / "model", "qwen2_5_vl")
    write_colour_task(tmp / "data", train_size=8, test_size=2)
    return [f"actor_rollout_ref.model.path={tmp / 'model'}",
            f"data.train_files={tmp / 'data' / 'train.parquet'}",
            f"data.val_files={tmp / 'data' / 'test.parquet'}",
            f"trainer.default_local_dir={tmp / 'run'}"]  # fmt: skip


def _problems(files: list[str], *overrides: str) -> list[str]:
    cfg = load_config(CONFIG, [*files, *overrides])
    try:
        validate(cfg, 2, check_paths=True)
    except ConfigError as exc:
        return exc.problems
    return []


def test_the_tiny_vl_config_validates(files):
    assert _problems(files) == []
    assert _problems(files, "actor_rollout_ref.actor.freeze_vision_tower=true") == []


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["actor_rollout_ref.model.use_remove_padding=true"], "model.use_remove_padding=true"),
        ([f"{A}use_remove_padding=true"], "actor.megatron.use_remove_padding=true"),
        ([f"{A}tensor_model_parallel_size=1", f"{A}context_parallel_size=2"],
         "context_parallel_size=2"),
        ([f"{A}sequence_parallel=true"], "sequence_parallel=true"),
        ([f"{A}tensor_model_parallel_size=1", f"{A}pipeline_model_parallel_size=2",
          f"{A}virtual_pipeline_model_parallel_size=2"], "virtual_pipeline_model_parallel_size=2"),
        (["actor_rollout_ref.model.lora.rank=4"], "lora.rank=4"),
        ([f"{A}router_replay.mode=R2"], "router_replay.mode=R2"),
        (["actor_rollout_ref.rollout.name=actor"], "rollout.name=actor"),
        (["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=2"],
         "rollout.nnodes=1"),
        (["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=2",
          "async_training.partial_rollout=true"], "partial_rollout=true"),
        (["actor_rollout_ref.rollout.multi_turn.enable=true"], "multi_turn.enable=true"),
        (["algorithm.adv_estimator=gae"], "critic"),
    ],
)  # fmt: skip
def test_what_a_vl_actor_cannot_do_is_one_line_naming_its_key(files, overrides, key):
    problems = _problems(files, *overrides)
    ours = [p for p in problems if key in p and "qwen2_5_vl" in p]
    assert len(ours) == 1, problems
    assert "\n" not in ours[0]


def test_freeze_vision_tower_on_a_text_model_is_refused(files, tmp_path):
    from megarl.models.tiny import make_tiny_model

    make_tiny_model(tmp_path / "text", family="qwen2", seed=1)
    cfg = load_config(CONFIG, [*files, f"actor_rollout_ref.model.path={tmp_path / 'text'}",
                               "actor_rollout_ref.actor.freeze_vision_tower=true"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"freeze_vision_tower=true needs a vision-language"):
        validate(cfg, 2, check_paths=True)


def test_megarl_train_refuses_packed_image_rows_in_one_line(files):
    done = subprocess.run(
        [sys.executable, "-m", "megarl.cli", "train", "--check", "-c", str(CONFIG), *files,
         "actor_rollout_ref.model.use_remove_padding=true"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(lines) == 1 and "use_remove_padding=true" in lines[0], lines
