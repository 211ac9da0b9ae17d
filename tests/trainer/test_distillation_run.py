"""On-policy distillation through ``megarl train`` (issue 57, the Megatron teacher): the README's
main job with ``distillation.enabled`` and a frozen Megatron teacher on the training ranks
(``inference.name=megatron``, TP 2 like the student), the distillation loss alone
(``forward_kl_topk`` over the teacher's top 32, verl's default; supervised), one mini-batch a
step. (k3 through ``megarl train``: the learning test in ``test_grpo_learning.py``.)

The teacher is the student's own checkpoint, so at the first step the teacher's top-k pass and
the update's student forward at those ids must agree (divergence 0 to rounding, the same
probability mass on the top-k from both sides); the truncated KL's gradient is not zero (the
top-k hold less than all the mass), so the second step's student has moved and the frozen
teacher has not."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._run_outputs import launch_quickstart, read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.multirank]


@pytest.mark.parametrize("student", ["full", "lora"])
def test_a_megatron_teacher_scores_the_students_samples_in_its_own_phase(tmp_path: Path, student):
    """``lora``: the student trains rank-8 adapters on the same base (zero at the start, so
    step 1 is as exact)."""
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
        "distillation.distillation_loss.loss_mode=forward_kl_topk",
        *(["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.alpha=16"]
          if student == "lora" else []),
    ])  # fmt: skip
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    steps = read_metrics(out / "runs" / "grpo_tiny_cpu")
    first, second = steps[1], steps[2]
    assert abs(first["actor/distillation/divergence"]) <= 1e-6, first
    assert first["actor/distillation/loss"] == first["actor/loss"]  # the task's loss dropped
    mass = first["actor/distillation/teacher_mass"]
    assert 0.01 < mass < 1.0, first  # 32 of 1000 tokens: a part of the mass
    assert abs(first["actor/distillation/student_mass"] - mass) <= 1e-6, first
    assert first["actor/grad_norm"] > 1e-3, first  # the truncation's gradient
    assert first["timing_s/teacher"] > 0 and second["timing_s/teacher"] > 0
    assert second["actor/distillation/divergence"] > 1e-4, second  # the student moved, not it


def test_a_vllm_teacher_on_a_rank_of_its_own_scores_the_students_samples(tmp_path: Path):
    """verl's way: the teacher served by vLLM on a pool of its own (``distillation.nnodes`` ×
    ``n_gpus_per_node`` = 1 rank after the training rank), its top-k from vLLM's prompt
    log-probs. The teacher is the student's checkpoint again and the rollout temperature 1, as
    vLLM scores: at step 1 its top-k and the student's log-probs at those ids agree to the
    engines' difference (vLLM against Megatron, fp32), which a shift of one position or a wrong
    id would break by orders of magnitude."""
    out = tmp_path / "run"
    (out / "tmp").mkdir(parents=True)
    proc = launch_quickstart(out, [
        "--nproc", "1", "trainer.total_training_steps=2", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.save_freq=-1",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.use_kl_loss=false",
        "distillation.enabled=true", "distillation.nnodes=1", "distillation.n_gpus_per_node=1",
        f"+distillation.teacher_models.teacher_model.model_path={out / 'tiny-qwen2'}",
        "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=1",
        "distillation.distillation_loss.use_task_rewards=false",
        "distillation.distillation_loss.loss_mode=forward_kl_topk",
    ])  # fmt: skip
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    steps = read_metrics(out / "runs" / "grpo_tiny_cpu")
    first, second = steps[1], steps[2]
    assert abs(first["actor/distillation/divergence"]) <= 1e-5, first  # measured 1.1e-7
    mass = first["actor/distillation/teacher_mass"]
    assert 0.01 < mass < 1.0, first
    assert abs(first["actor/distillation/student_mass"] - mass) <= 1e-5, first
    assert first["timing_s/teacher"] > 0 and second["timing_s/teacher"] > 0
    assert second["actor/distillation/divergence"] > 1e-3, second  # the student moved, not it
