"""On-policy distillation's teacher scores of the step's samples (``distillation.*``).

The step calls :func:`score_batch` after the reference's pass; it fills the batch's
``teacher_log_probs`` (the sampled tokens' log-probs, every loss mode) and, for a top-k loss mode
(``forward_kl_topk``), ``teacher_topk_log_probs`` and ``teacher_topk_ids`` (``[B, R, k]``, the
k = ``distillation_loss.topk`` largest at each response position, by rank), which the update
scores the student at (:mod:`megarl.trainer.update`).

The teacher is a frozen Megatron model on the training ranks at the actor's layout
(``inference.name=megatron``; built by :func:`megarl.trainer.setup.setup`), its pass batched as
the reference's (``actor_rollout_ref.ref.log_prob_*``) at the rollout temperature, its
parameters on the device by the ``teacher`` phase's residency.
"""

from __future__ import annotations

from megarl.algo.distillation import TOPK_LOSS_MODES
from megarl.trainer.batch import StepBatch
from megarl.trainer.passes import global_pass


def topk_of(cfg) -> int | None:
    """The k the update scores the student at: ``distillation_loss.topk`` for a top-k loss
    mode, else None (the estimator modes read the sampled token only)."""
    loss = cfg.distillation.distillation_loss
    return int(loss.topk) if loss.loss_mode in TOPK_LOSS_MODES else None


def score_batch(run, batch: StepBatch) -> None:
    """The teacher's scores of ``batch`` into its ``teacher_*`` fields (every rank)."""
    plan = run.plan.ref_log_prob
    topk = topk_of(run.cfg)
    out = global_pass(
        run.teacher.chunks,
        batch,
        "actor",
        micro_batches=plan.micro_batch_size,
        max_token_len=plan.max_token_len_per_gpu,
        pack=run.teacher.pack,
        vocab_size=run.vocab_size,
        temperature=run.cfg.actor_rollout_ref.rollout.temperature,
        topk=topk,
    )
    batch.teacher_log_probs = out["log_probs"]
    if topk is not None:
        batch.teacher_topk_log_probs = out["topk_log_probs"]
        batch.teacher_topk_ids = out["topk_ids"]
