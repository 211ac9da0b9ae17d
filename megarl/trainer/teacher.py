"""On-policy distillation's teacher scores of the step's samples (``distillation.*``).

The step calls :func:`score_batch` after the reference's pass; it fills the batch's
``teacher_log_probs`` (the sampled tokens' log-probs, every loss mode) and, for a top-k loss mode
(``forward_kl_topk``), ``teacher_topk_log_probs`` and ``teacher_topk_ids`` (``[B, R, k]``, the
k = ``distillation_loss.topk`` largest at each response position, by rank), which the update
scores the student at (:mod:`megarl.trainer.update`).

The teacher is either a frozen Megatron model on the training ranks at the actor's layout or at
its own TP × PP (``inference.name=megatron``, ``inference.tensor_model_parallel_size`` ×
``pipeline_model_parallel_size``; built by :func:`megarl.trainer.setup.build_run`, its pass run
inside its own parallel state: :func:`megarl.parallel.init.second_layout`), its pass batched
as the reference's (``actor_rollout_ref.ref.log_prob_*``) at the rollout temperature, its
parameters on the device by the ``teacher`` phase's residency; or vLLM on ranks of its own
(``inference.name=vllm``, verl's way: :mod:`megarl.rollout.remote.teacher`), which scores at
temperature 1 (vLLM's prompt log-probs come from the raw logits, as verl's vLLM teacher's).
Several vLLM teachers each score the samples whose ``distillation.teacher_key`` value equals
their ``key`` (:func:`routes_of`; verl's routing, ``data_source`` by default); a value no
teacher names stops the step with one line naming the sample's file and row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from megarl.algo.distillation import TOPK_LOSS_MODES
from megarl.config.teachers import teachers
from megarl.trainer.batch import StepBatch
from megarl.trainer.passes import global_pass, pad_to_width


class RoutingError(ValueError):
    """A sample whose ``distillation.teacher_key`` value no teacher's ``key`` names: one line."""


def topk_of(cfg) -> int | None:
    """The k the update scores the student at: ``distillation_loss.topk`` for a top-k loss
    mode, else None (the estimator modes read the sampled token only)."""
    loss = cfg.distillation.distillation_loss
    return int(loss.topk) if loss.loss_mode in TOPK_LOSS_MODES else None


def present(run) -> bool:
    """The run distils from a teacher (a Megatron one here, or vLLM's on ranks of its own)."""
    return run.teacher is not None or run.teacher_client is not None


def routing_value(cfg, prompt) -> Any:
    """A prompt's ``distillation.teacher_key`` value: its ``data_source`` (verl's default key;
    also under ``data.reward_fn_key``'s name), its ``ability``, or its ``extra_info[key]``
    (None when it has none)."""
    key = cfg.distillation.teacher_key
    if key in ("data_source", cfg.data.reward_fn_key):
        return prompt.data_source
    if key == "ability":
        return prompt.ability
    extra = getattr(prompt, "extra_info", None)
    return extra.get(key) if isinstance(extra, dict) else None


def routes_of(cfg, prompts: Sequence[Any]) -> list[int] | None:
    """The teacher (an index of :func:`megarl.config.teachers.teachers`) scoring each of
    ``prompts`` (one per response), by ``teacher_key``; None with a single teacher, which takes
    every sample. Raises :class:`RoutingError` for a value no teacher's key names."""
    found = teachers(cfg)
    if len(found) < 2 and (not found or found[0].key is None):
        return None
    index = {t.key: i for i, t in enumerate(found)}
    routes = []
    for prompt in prompts:
        value = routing_value(cfg, prompt)
        if str(value) not in index:
            where = getattr(prompt, "source", "") or "a sample"
            known = ", ".join(f"{t.key} -> {t.name}" for t in found)
            raise RoutingError(
                f"distillation.teacher_key={cfg.distillation.teacher_key}: {where} has "
                f"{value!r}, which no teacher's key names ({known})"
            )
        routes.append(index[str(value)])
    return routes


def score_batch(run, batch: StepBatch, prompts: Sequence[Any] = ()) -> dict[str, float]:
    """The teachers' scores of ``batch`` into its ``teacher_*`` fields (every rank); ``prompts``:
    each response's prompt (routing by ``teacher_key``). Returns each teacher's metrics:
    ``distillation/<name>/sequences`` and ``distillation/<name>/k1_vs_rollout``, the mean over
    its response tokens of the rollout's log-prob less the teacher's (the student's divergence
    from it on its own samples, as the rollout sampled them)."""
    routes = routes_of(run.cfg, prompts) if prompts else None
    if run.teacher_client is not None:
        _remote_scores(run, batch, routes)
    else:
        _megatron_scores(run, batch)
    return _teacher_metrics(run.cfg, batch, routes)


def _teacher_metrics(cfg, batch: StepBatch, routes: list[int] | None) -> dict[str, float]:
    found = teachers(cfg)
    rows = torch.tensor(routes) if routes is not None else torch.zeros(len(batch), dtype=torch.long)
    mask = batch.response_mask.float()
    gap = (batch.rollout_log_probs.float() - batch.teacher_log_probs.float()) * mask
    out: dict[str, float] = {}
    for i, spec in enumerate(found):
        mine = rows == i
        tokens = float(mask[mine].sum())
        out[f"distillation/{spec.name}/sequences"] = float(mine.sum())
        if tokens:
            out[f"distillation/{spec.name}/k1_vs_rollout"] = float(gap[mine].sum()) / tokens
    return out


def _megatron_scores(run, batch: StepBatch) -> None:
    plan = run.plan.ref_log_prob
    topk = topk_of(run.cfg)
    own = run.teacher.meta.get("layout_state")  # a TP x PP of its own: its parallel state
    with own.entered() if own is not None else contextlib.nullcontext():
        out = _teacher_pass(run, batch, plan, topk)
    batch.teacher_log_probs = out["log_probs"]
    if topk is not None:
        batch.teacher_topk_log_probs = out["topk_log_probs"]
        batch.teacher_topk_ids = out["topk_ids"]


def _teacher_pass(run, batch: StepBatch, plan, topk: int | None) -> dict:
    return global_pass(
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


def _remote_scores(run, batch: StepBatch, routes: list[int] | None) -> None:
    """The vLLM teachers' scores (temperature 1: vLLM's prompt log-probs are the raw logits')
    of every sequence, prompt and response, from the teacher ranks (``routes``: the teacher of
    each; None: the single one)."""
    from megarl.rollout.remote.teacher import teacher_topk

    lengths, prompts = batch.lengths.tolist(), batch.prompt_lengths.tolist()
    sequences = [row[:n] for row, n in zip(batch.input_ids.tolist(), lengths, strict=True)]
    scores = run.teacher_client.score(sequences, prompts, teacher_topk(run.cfg), routes)
    width = batch.response_mask.shape[1]
    batch.teacher_log_probs = pad_to_width(scores.log_probs, width)
    if topk_of(run.cfg) is not None:
        batch.teacher_topk_log_probs = pad_to_width(scores.topk_log_probs, width)
        batch.teacher_topk_ids = pad_to_width(scores.topk_ids, width)
