"""A step's metrics, with verl's names: data (scores, rewards, advantages, lengths), values,
the rollout's agreement with the actor, timing and throughput."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from megarl.algo import masked_mean, masked_var
from megarl.reward import RewardResult
from megarl.rollout.consistency import logprob_diff_metrics
from megarl.trainer.batch import StepBatch
from megarl.trainer.residency import phase_peak_metrics


def _synchronize() -> None:
    """Wait for this rank's queued GPU work (a no-op without CUDA): a phase's seconds then
    hold its kernels, not only their launches (sync GB/s and MFU would read high)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Timer:
    """``timing_s/<phase>`` metrics, CUDA-synchronised at each phase's start and end."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        _synchronize()
        start = time.perf_counter()
        yield
        _synchronize()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}


def _stats(name: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    v = values.float()
    return {
        f"{name}/mean": float(v.mean()),
        f"{name}/max": float(v.max()),
        f"{name}/min": float(v.min()),
    }


def batch_metrics(batch: StepBatch, scored: RewardResult, max_response: int) -> dict:
    """verl's data metrics: scores, rewards, advantages, returns, lengths."""
    mask = batch.response_mask.bool()
    metrics: dict[str, float] = {}
    metrics.update(_stats("critic/score", scored.scores))
    metrics.update(_stats("critic/rewards", batch.token_level_rewards.sum(-1)))
    metrics.update(_stats("critic/advantages", batch.advantages[mask]))
    metrics.update(_stats("critic/returns", batch.returns[mask]))
    response = batch.response_lengths
    metrics.update(_stats("response_length", response))
    metrics["response_length/clip_ratio"] = float((response >= max_response).float().mean())
    metrics.update(_stats("prompt_length", batch.prompt_lengths))
    return metrics


def step_metrics(
    run, batch: StepBatch, scored: RewardResult, timer: Timer, start: float
) -> dict[str, float]:
    """Rewards, data, consistency, timing and throughput metrics of a finished step."""
    metrics = dict(scored.metrics)
    metrics.update(batch_metrics(batch, scored, run.cfg.data.max_response_length))
    if batch.values is not None:
        metrics.update(value_metrics(batch))
    if batch.recomputed_log_probs is not None:  # bypass mode computes no actor log-probs
        metrics.update(rollout_consistency(batch, batch.recomputed_log_probs))
    metrics.update(timer.metrics())
    metrics.update(phase_peak_metrics(run))
    metrics["timing_s/step"] = time.perf_counter() - start
    tokens = float(batch.lengths.sum())
    metrics["perf/total_num_tokens"] = tokens
    metrics["perf/throughput"] = tokens / metrics["timing_s/step"] / run.world_size
    return metrics


def rollout_consistency(batch: StepBatch, recomputed: torch.Tensor) -> dict[str, float]:
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


def value_metrics(batch: StepBatch) -> dict[str, float]:
    """verl's ``critic/values/*`` and ``critic/vf_explained_var`` (1 - Var(R - V) / Var(R))."""
    mask = batch.response_mask.bool()
    values, returns = batch.values, batch.returns
    out: dict[str, float] = {}
    if mask.any():
        v = values[mask]
        out = {"critic/values/mean": float(v.mean()), "critic/values/max": float(v.max()),
               "critic/values/min": float(v.min())}  # fmt: skip
        var_returns = masked_var(returns, mask)
        explained = 1.0 - masked_var(returns - values, mask) / (var_returns + 1e-5)
        out["critic/vf_explained_var"] = float(explained)
        out["critic/value_mean_error"] = float(masked_mean(values - returns, mask))
    return out
