"""On-policy distillation through ``megarl train`` (issue 57, the Megatron teacher): the README's
main job with ``distillation.enabled`` and a frozen Megatron teacher on the training ranks
(``inference.name=megatron``, at TP 1 × PP 2 beside the student's TP 2, or at the student's
layout), the distillation loss alone
(``forward_kl_topk`` over the teacher's top 32, verl's default; supervised), one mini-batch a
step. (k3 through ``megarl train``: the learning test in ``test_grpo_learning.py``.)

The teacher is the student's own checkpoint, so at the first step the teacher's top-k pass and
the update's student forward at those ids must agree (divergence 0 to rounding, the same
probability mass on the top-k from both sides); the truncated KL's gradient is not zero (the
top-k hold less than all the mass), so the second step's student has moved and the frozen
teacher has not. The vLLM teachers on ranks of their own, routed by ``teacher_key``: the last
test."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._run_outputs import launch_quickstart, read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.multirank]
INFERENCE = "distillation.teacher_models.teacher_model.inference"


@pytest.mark.parametrize("student", ["full", "lora"])
def test_a_megatron_teacher_scores_the_students_samples_in_its_own_phase(tmp_path: Path, student):
    """``full``: the teacher at a layout of its own, TP 1 × PP 2 beside the student's TP 2
    (its own parallel state over the same two ranks); ``lora``: at the student's, which trains
    rank-8 adapters on the same base (zero at the start, so step 1 is as exact)."""
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
          if student == "lora" else
          [f"{INFERENCE}.tensor_model_parallel_size=1", f"+{INFERENCE}.pipeline_model_parallel_size=2"]),
    ])  # fmt: skip
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    layout = "TP 2 × PP 1" if student == "lora" else "TP 1 × PP 2"
    assert f"teacher megatron {layout} on the training ranks" in stdout, stdout
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


def _routed_rows(path: Path, per_step: int, teachers: list[str]) -> Path:
    """The synthetic task's rows, ``per_step`` (a step's prompts) routed to each of
    ``teachers`` in turn, by an ``extra_info`` field ``teacher``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megarl.data.synthetic import make_rows

    rows = make_rows(per_step * len(teachers), split="train", seed=0)
    for i, row in enumerate(rows):
        row["extra_info"]["teacher"] = teachers[i // per_step]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_two_vllm_teachers_on_ranks_of_their_own_score_the_samples_routed_to_them(tmp_path: Path):
    """verl's way: the teachers served by vLLM on a pool of their own (``distillation.nnodes`` ×
    ``n_gpus_per_node`` = 2 ranks after the training rank and a rollout rank of vLLM's own, one
    step off; one teacher replica of TP 1 each), their
    top-k from vLLM's prompt log-probs, each sample routed by ``teacher_key`` (here an
    ``extra_info`` field) to the teacher whose ``key`` it names. Teacher ``same`` is the
    student's checkpoint, ``other`` a tiny model of other weights; steps 1 and 2 go to
    ``same``, step 3 to ``other`` (the data in order).

    With the rollout temperature 1, as vLLM scores: at step 1 ``same``'s top-k and the
    student's log-probs at those ids agree to the engines' difference (vLLM against Megatron,
    fp32), which a shift of one position or a wrong id would break by orders of magnitude; at
    step 2 the student has moved and the frozen teacher not. The routing: each step's samples
    counted under the teacher they went to, and the rollout's log-probs against the teacher's
    near 0 for ``same`` and far from it for ``other`` (a swap, or every sample to one teacher,
    fails one of the three steps). One step off, step 2 samples from the initial weights, the
    first teacher's own: its k1 against the rollout is near 0 again."""
    from megarl.models.tiny import make_tiny_model

    out = tmp_path / "run"
    (out / "tmp").mkdir(parents=True)
    other = make_tiny_model(tmp_path / "other", seed=7)
    data = _routed_rows(tmp_path / "data" / "train.parquet", 8, ["same", "same", "other"])
    T = "+distillation.teacher_models"
    proc = launch_quickstart(out, [
        "--nproc", "1", "trainer.total_training_steps=3", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.save_freq=-1", f"data.train_files={data}",
        "data.shuffle=false",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.use_kl_loss=false",
        "distillation.enabled=true", "distillation.nnodes=1", "distillation.n_gpus_per_node=2",
        "distillation.teacher_key=teacher",
        "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "async_training.staleness_threshold=1",
        *[f"{T}.{name}.{key}={value}" for name, path in (("same", out / "tiny-qwen2"), ("other", other))
          for key, value in (("key", name), ("model_path", path), ("num_replicas", 1),
                             ("inference.tensor_model_parallel_size", 1))],
        "distillation.distillation_loss.use_task_rewards=false",
        "distillation.distillation_loss.loss_mode=forward_kl_topk",
    ])  # fmt: skip
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    assert "2 vllm teachers routed by teacher on ranks of their own" in stdout, stdout
    steps = read_metrics(out / "runs" / "grpo_tiny_cpu")
    first, second, third = steps[1], steps[2], steps[3]
    assert abs(first["actor/distillation/divergence"]) <= 1e-5, first  # measured 1.1e-7
    mass = first["actor/distillation/teacher_mass"]
    assert 0.01 < mass < 1.0, first
    assert abs(first["actor/distillation/student_mass"] - mass) <= 1e-5, first
    assert first["timing_s/teacher"] > 0 and second["timing_s/teacher"] > 0
    assert second["actor/distillation/divergence"] > 1e-3, second  # the student moved, not it
    responses = 8 * 8
    for metrics, to in ((first, "same"), (second, "same"), (third, "other")):
        away = "other" if to == "same" else "same"
        assert metrics[f"distillation/{to}/sequences"] == responses, metrics
        assert metrics[f"distillation/{away}/sequences"] == 0, metrics
        assert f"distillation/{away}/k1_vs_rollout" not in metrics, metrics
    assert abs(first["distillation/same/k1_vs_rollout"]) <= 1e-4, first
    assert third["distillation/other/k1_vs_rollout"] > 0.5, third
    # one step off: step 2's samples come from the initial weights too, the teacher's own
    assert [steps[s]["async/staleness_max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert abs(second["distillation/same/k1_vs_rollout"]) <= 1e-4, second
