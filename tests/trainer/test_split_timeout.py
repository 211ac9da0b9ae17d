"""``actor_rollout_ref.nccl_timeout`` reaches the groups between training and rollout ranks."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

GRPO = Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny_cpu.yaml"
ROLL = "actor_rollout_ref.rollout"


def test_the_split_world_waits_as_long_as_nccl_timeout_says(monkeypatch, tmp_path):
    from megarl.config import load_config
    from megarl.rollout.remote import split_world
    from megarl.trainer import loop

    cfg = load_config(GRPO, [f"{ROLL}.nnodes=1", f"{ROLL}.n_gpus_per_node=1",
                             f"{ROLL}.tensor_model_parallel_size=1",
                             "actor_rollout_ref.nccl_timeout=1200",
                             f"trainer.default_local_dir={tmp_path}"])  # fmt: skip
    seen = {}

    def split(train_size, *, teacher_size=0, teacher_sizes=(), timeout=None):
        seen.update(train_size=train_size, teacher_size=teacher_size, timeout=timeout)
        raise RuntimeError("split here")

    monkeypatch.setattr(split_world, "split_world", split)
    with pytest.raises(RuntimeError, match="split here"):
        loop.run(cfg)
    assert seen == {"train_size": 2, "teacher_size": 0, "timeout": timedelta(minutes=20)}
