"""One training step, top to bottom, and one validation pass.

Step: global prompt batch → generate (rollout engine) → decode + score → old log-probs, ref
log-probs (at the rollout temperature) → advantages over the global batch → actor update →
weight sync → metrics. Every rank runs the same code on the same global batch (SPMD).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from megarl.algo import compute_advantage, compute_rollout_is_weights, masked_mean
from megarl.data import PromptSample
from megarl.reward import RewardInput, RewardResult
from megarl.rollout.consistency import logprob_diff_metrics
from megarl.trainer.actor import update_policy
from megarl.trainer.batch import RolloutTensors
from megarl.trainer.passes import generate, global_log_probs
from megarl.trainer.setup import Run


class Timer:
    """``timing_s/<phase>`` metrics."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}


def train_step(
    run: Run, step: int, prompts: Sequence[PromptSample]
) -> tuple[dict[str, float], RolloutTensors]:
    """Run training step ``step`` (1-based) on the global prompt batch ``prompts``; returns its
    metrics and the step's batch (tokens, rewards, log-probs, advantages: identical on every
    rank)."""
    cfg = run.cfg
    rollout_cfg = cfg.actor_rollout_ref.rollout
    correction = cfg.algorithm.rollout_correction
    timer = Timer()
    start = time.perf_counter()

    with timer("gen"):
        batch, samples = generate(
            run.engine,
            prompts,
            n=rollout_cfg.n,
            sampling=training_sampling(run),
            seed=cfg.trainer.seed,
            step=step,
            pad_token_id=_pad_id(run),
        )
    with timer("reward"):
        scored = _score(run, prompts, samples, batch, step, dump=cfg.trainer.rollout_data_dir)
        batch.fields["token_level_rewards"] = scored.token_level_rewards
    # verl's shortcut: with one mini-batch, one epoch, no IS weights and nothing else needing
    # them first, the old log-probs are the current ones; the update's forward provides them.
    actor_cfg = cfg.actor_rollout_ref.actor
    shortcut = (
        run.policy.ppo_epochs == 1
        and run.policy.responses_per_mini_batch == len(batch)
        and not correction.bypass_mode
        and correction.rollout_is is None
        and not actor_cfg.calculate_sum_pi_squared
    )
    sum_pi_squared = None
    if not shortcut:
        with timer("old_log_prob"):
            old, _entropy, sum_pi_squared = global_log_probs(
                run.actor.chunks,
                batch,
                vocab_size=run.vocab_size,
                temperature=rollout_cfg.temperature,
                micro_batches=run.plan.old_log_prob.micro_batch_size,
                max_token_len=run.plan.old_log_prob.max_token_len_per_gpu,
                sum_pi_squared=actor_cfg.calculate_sum_pi_squared,
            )
            batch.fields["recomputed_log_probs"] = old
    if run.ref is not None:
        with timer("ref"):
            batch.fields["ref_log_probs"], _, _ = global_log_probs(
                run.ref.chunks,
                batch,
                vocab_size=run.vocab_size,
                temperature=rollout_cfg.temperature,
                micro_batches=run.plan.ref_log_prob.micro_batch_size,  # type: ignore[union-attr]
                max_token_len=run.plan.ref_log_prob.max_token_len_per_gpu,  # type: ignore[union-attr]
            )
    # Rollout log-prob handling: decoupled (recomputed old log-probs anchor the ratio), bypass
    # (the rollout's own), optionally with truncated importance weights pi_old / pi_rollout.
    mask = batch.response_mask
    metrics: dict[str, float] = {}
    if not shortcut:
        batch.fields["old_log_probs"] = (
            batch.rollout_log_probs
            if correction.bypass_mode
            else batch.fields["recomputed_log_probs"]
        )
    if correction.rollout_is is not None and not correction.bypass_mode:
        weights, is_metrics = compute_rollout_is_weights(
            batch.fields["recomputed_log_probs"],
            batch.rollout_log_probs,
            mask,
            rollout_is=correction.rollout_is,
            rollout_is_threshold=correction.rollout_is_threshold,
            rollout_is_batch_normalize=correction.rollout_is_batch_normalize,
        )
        batch.fields["rollout_is_weights"] = weights
        metrics.update({f"rollout_corr/{k}": float(v) for k, v in is_metrics.items()})

    with timer("adv"):
        advantages, returns = compute_advantage(
            cfg.algorithm.adv_estimator,
            token_level_rewards=batch.fields["token_level_rewards"],
            response_mask=mask,
            index=batch.prompt_ids,
            gamma=cfg.algorithm.gamma,
            lam=cfg.algorithm.lam,
            norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
            reward_components=scored.fields,
            old_log_prob=batch.fields.get("old_log_probs"),
            sum_pi_squared=sum_pi_squared,
        )
        batch.fields["advantages"], batch.fields["returns"] = advantages, returns

    with timer("update_actor"):
        metrics.update(
            update_policy(
                run.actor,
                batch,
                run.policy,
                vocab_size=run.vocab_size,
                seed=cfg.trainer.seed,
                step=step,
                old_log_probs="current" if shortcut else "old_log_probs",
            )
        )
    run.actor.advance_lr()  # verl steps the LR schedule once per trainer step
    with timer("update_weights"):
        if step not in cfg.trainer.skip_weight_sync_steps:
            sync_engine(run)

    metrics.update(scored.metrics)
    metrics.update(batch_metrics(batch, scored, cfg.data.max_response_length))
    metrics.update(rollout_consistency(batch, batch.fields["recomputed_log_probs"]))
    metrics.update(timer.metrics())
    metrics["timing_s/step"] = time.perf_counter() - start
    tokens = float(batch.lengths.sum())
    metrics["perf/total_num_tokens"] = tokens
    metrics["perf/throughput"] = tokens / metrics["timing_s/step"] / run.world_size
    return metrics, batch


def validate(run: Run, step: int) -> dict[str, float]:
    """Generate for the whole validation set with ``rollout.val_kwargs``; mean score per
    ``data_source`` (``val-core/<source>/reward/mean@<n>``) and over all (``val/score/mean``)."""
    cfg = run.cfg
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    prompts = [run.val_data[i] for i in range(len(run.val_data))]  # type: ignore[arg-type]
    sampling = {
        "temperature": val.temperature if val.do_sample else 0.0,
        "top_p": val.top_p if val.do_sample else 1.0,
        "top_k": val.top_k if val.do_sample else -1,
        "max_tokens": cfg.actor_rollout_ref.rollout.response_length,
    }
    batch, samples = generate(
        run.engine,
        prompts,
        n=val.n,
        sampling=sampling,
        seed=cfg.trainer.seed,
        step=-1,  # validation draws are the same at every validation
        pad_token_id=_pad_id(run),
    )
    scored = _score(run, prompts, samples, batch, step, dump=cfg.trainer.validation_data_dir)
    sources = [prompts[s.prompt_index].data_source for s in samples]
    metrics = {"val/score/mean": float(scored.scores.mean())}
    for source in sorted(set(sources)):
        rows = torch.tensor([s == source for s in sources])
        metrics[f"val-core/{source}/reward/mean@{val.n}"] = float(scored.scores[rows].mean())
    return metrics


def training_sampling(run: Run) -> dict[str, float | int]:
    roll = run.cfg.actor_rollout_ref.rollout
    return {
        "temperature": roll.temperature if roll.do_sample else 0.0,
        "top_p": roll.top_p,
        "top_k": roll.top_k,
        "max_tokens": roll.response_length,
    }


def sync_engine(run: Run) -> None:
    """Push the actor's weights into the rollout engine (nothing to do when it is the actor)."""
    if run.reshard_plan is None:
        return
    from megarl.rollout.reshard import sync_weights

    sync_weights(run.actor.chunks, run.reshard_plan, run.engine)


def _score(run, prompts, samples, batch: RolloutTensors, step: int, dump) -> RewardResult:
    inputs = [
        RewardInput(
            data_source=prompts[s.prompt_index].data_source,
            response_ids=s.response_token_ids,
            ground_truth=prompts[s.prompt_index].ground_truth,
            extra_info=prompts[s.prompt_index].extra_info,
            prompt=run.tokenizer.decode(s.prompt_token_ids, skip_special_tokens=False),
        )
        for s in samples
    ]
    return run.rewards(
        inputs, response_width=batch.response_mask.shape[1], dump_dir=dump, step=step
    )


def _pad_id(run: Run) -> int:
    pad = run.tokenizer.pad_token_id
    return int(pad if pad is not None else (run.tokenizer.eos_token_id or 0))


def _stats(name: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    v = values.float()
    return {
        f"{name}/mean": float(v.mean()),
        f"{name}/max": float(v.max()),
        f"{name}/min": float(v.min()),
    }


def batch_metrics(batch: RolloutTensors, scored: RewardResult, max_response: int) -> dict:
    """verl's data metrics: scores, rewards, advantages, returns, lengths."""
    mask = batch.response_mask.bool()
    metrics: dict[str, float] = {}
    metrics.update(_stats("critic/score", scored.scores))
    metrics.update(_stats("critic/rewards", batch.fields["token_level_rewards"].sum(-1)))
    metrics.update(_stats("critic/advantages", batch.fields["advantages"][mask]))
    metrics.update(_stats("critic/returns", batch.fields["returns"][mask]))
    response = batch.response_lengths
    metrics.update(_stats("response_length", response))
    metrics["response_length/clip_ratio"] = float((response >= max_response).float().mean())
    metrics.update(_stats("prompt_length", batch.prompt_lengths))
    return metrics


def rollout_consistency(batch: RolloutTensors, recomputed: torch.Tensor) -> dict[str, float]:
    """The rollout engine's log-probs vs the actor's on the rollout's own tokens: the proof that
    the last weight sync worked (and NeMo-RL's token probability ratio error)."""
    mask = batch.response_mask.bool()
    out = {
        f"rollout/{k.split('/')[-1]}": v
        for k, v in logprob_diff_metrics(batch.rollout_log_probs, recomputed, mask).items()
    }
    diff = (batch.rollout_log_probs - recomputed).abs()
    out["rollout/token_mult_prob_error"] = (
        float(masked_mean(torch.exp(diff), mask)) if mask.any() else 1.0
    )
    return out
