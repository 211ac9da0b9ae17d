"""On-policy distillation through ``megarl train`` (issue 57, the Megatron teacher): the README's
main job with ``distillation.enabled`` and a frozen Megatron teacher on the training ranks
(``inference.name=megatron``, TP 2 like the student), the distillation loss alone (k3,
supervised), one mini-batch a step.

The teacher is the student's own checkpoint, so the first step has nothing to learn: the
teacher's pass must give the student's log-probs to the last bit (divergence 0, a zero
gradient); the second step's student has moved (Adam steps even on a zero-mean gradient) and
the frozen teacher has not."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._run_outputs import launch_quickstart, read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.multirank]


def test_a_megatron_teacher_scores_the_students_samples_in_its_own_phase(tmp_path: Path):
    out = tmp_path / "run"
    (out / "tmp").mkdir(parents=True)
    teacher = out / "tiny-qwen2"  # the student's checkpoint, made by the quickstart itself
    proc = launch_quickstart(out, [
        "trainer.total_training_steps=2", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.save_freq=-1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",  # one mini-batch: step 1 is exact
        "actor_rollout_ref.actor.use_kl_loss=false",
        "distillation.enabled=true", "distillation.nnodes=0",
        f"+distillation.teacher_models.teacher_model.model_path={teacher}",
        "distillation.teacher_models.teacher_model.inference.name=megatron",
        "distillation.distillation_loss.use_task_rewards=false",
    ])  # fmt: skip
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    steps = read_metrics(out / "runs" / "grpo_tiny_cpu")
    first, second = steps[1], steps[2]
    assert abs(first["actor/distillation/divergence"]) <= 1e-6, first
    assert first["actor/distillation/loss"] == first["actor/loss"]  # the task's loss dropped
    assert first["actor/grad_norm"] <= 1e-3, first  # the teacher is the student: nothing to learn
    assert first["timing_s/teacher"] > 0 and second["timing_s/teacher"] > 0
    assert second["actor/distillation/divergence"] > 1e-4, second  # the student moved, not it
