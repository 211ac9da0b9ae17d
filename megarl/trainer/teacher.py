"""On-policy distillation's teacher scores of the step's samples (``distillation.*``).

The step calls :func:`score_batch` after the reference's pass; it fills the batch's
``teacher_log_probs`` (the sampled tokens' log-probs, every loss mode) and, for a top-k loss mode
(``forward_kl_topk``), ``teacher_topk_log_probs`` and ``teacher_topk_ids`` (``[B, R, k]``, the
k = ``distillation_loss.topk`` largest at each response position, by rank), which the update
scores the student at (:mod:`megarl.trainer.update`).

The teacher is either a frozen Megatron model on the training ranks at the actor's layout
(``inference.name=megatron``; built by :func:`megarl.trainer.setup.build_run`), its pass batched
as the reference's (``actor_rollout_ref.ref.log_prob_*``) at the rollout temperature, its
parameters on the device by the ``teacher`` phase's residency; or vLLM on ranks of its own
(``inference.name=vllm``, verl's way: :mod:`megarl.rollout.remote.teacher`), which scores at
temperature 1 (vLLM's prompt log-probs come from the raw logits, as verl's vLLM teacher's).
"""

from __future__ import annotations

from megarl.algo.distillation import TOPK_LOSS_MODES
from megarl.trainer.batch import StepBatch
from megarl.trainer.passes import global_pass, pad_to_width


def topk_of(cfg) -> int | None:
    """The k the update scores the student at: ``distillation_loss.topk`` for a top-k loss
    mode, else None (the estimator modes read the sampled token only)."""
    loss = cfg.distillation.distillation_loss
    return int(loss.topk) if loss.loss_mode in TOPK_LOSS_MODES else None


def present(run) -> bool:
    """The run distils from a teacher (a Megatron one here, or vLLM's on ranks of its own)."""
    return run.teacher is not None or run.teacher_client is not None


def score_batch(run, batch: StepBatch) -> None:
    """The teacher's scores of ``batch`` into its ``teacher_*`` fields (every rank)."""
    if run.teacher_client is not None:
        _remote_scores(run, batch)
        return
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


def _remote_scores(run, batch: StepBatch) -> None:
    """The vLLM teacher's scores (temperature 1: vLLM's prompt log-probs are the raw logits')
    of every sequence, prompt and response, from the teacher ranks."""
    from megarl.rollout.remote.teacher import teacher_topk

    lengths, prompts = batch.lengths.tolist(), batch.prompt_lengths.tolist()
    sequences = [row[:n] for row, n in zip(batch.input_ids.tolist(), lengths, strict=True)]
    scores = run.teacher_client.score(sequences, prompts, teacher_topk(run.cfg))
    width = batch.response_mask.shape[1]
    batch.teacher_log_probs = pad_to_width(scores.log_probs, width)
    if topk_of(run.cfg) is not None:
        batch.teacher_topk_log_probs = pad_to_width(scores.topk_log_probs, width)
        batch.teacher_topk_ids = pad_to_width(scores.topk_ids, width)
