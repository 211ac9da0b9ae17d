"""When a run with vLLM on ranks of its own asks for batches, syncs its weights, validates and
saves: verl's fully-async schedule (``async_training.*``) in megarl's step numbers.

A megarl step is one update on one batch of ``data.train_batch_size`` prompts (verl's fully-async
``require_batches × ppo_mini_batch_size``; verl's ``global_steps``). The weights go to the rollout
ranks every ``trigger_parameter_sync_step`` = K steps (a *window*), so the weight version the
rollout ranks hold after ``v`` syncs is the actor after ``v·K`` updates (verl's
``current_param_version``). verl lets the rollouter generate at most
``(1 + staleness_threshold) · K`` batches per window; megarl asks for a step's batch as soon as
that bound allows: during step ``i`` (window ``w = (i - 1) // K``) it asks for the batches of
the steps up to ``K·(w + 1) + ceil(staleness_threshold · K)``. With K = 1 that is
``i + ceil(staleness_threshold)``, megarl's one-step-off rule.
"""

from __future__ import annotations

import math

from megarl.config.schema import MegarlConfig


def rollout_ranks(cfg: MegarlConfig) -> int:
    """Rollout-only processes after the training ones (0: vLLM shares the training ranks):
    rollout.nnodes × rollout.n_gpus_per_node (unset: trainer.n_gpus_per_node)."""
    roll = cfg.actor_rollout_ref.rollout
    per_node = roll.n_gpus_per_node or cfg.trainer.n_gpus_per_node
    return max(roll.nnodes, 0) * per_node


def sync_interval(cfg: MegarlConfig) -> int:
    """Updates between two weight syncs (``async_training.trigger_parameter_sync_step``; 1 when
    vLLM shares the training ranks)."""
    if not rollout_ranks(cfg):
        return 1
    return max(int(cfg.async_training.trigger_parameter_sync_step), 1)


def partial_rollouts(cfg: MegarlConfig) -> bool:
    """Whether the rollout ranks interrupt their requests at a weight sync and continue them on
    the new weights (``async_training.partial_rollout`` with vLLM on ranks of its own)."""
    return bool(rollout_ranks(cfg)) and bool(cfg.async_training.partial_rollout)


def extra_batches(cfg: MegarlConfig) -> int:
    """Batches of the next window that may be asked before this window's sync:
    ``ceil(staleness_threshold · K)``."""
    if not rollout_ranks(cfg):
        return 0
    threshold = max(float(cfg.async_training.staleness_threshold), 0.0)
    return math.ceil(threshold * sync_interval(cfg) - 1e-9)


def asks_ahead(cfg: MegarlConfig) -> bool:
    """Whether any step's batch is asked before that step starts."""
    return sync_interval(cfg) > 1 or extra_batches(cfg) > 0


def ask_limit(cfg: MegarlConfig, step: int) -> int:
    """The last step whose batch may be asked during step ``step`` (1-based; the module
    docstring): 0 extra batches and K = 1 give ``step`` (nothing asked ahead)."""
    k = sync_interval(cfg)
    return k * ((step - 1) // k + 1) + extra_batches(cfg)


def syncs_after(cfg: MegarlConfig, step: int, total_steps: int) -> bool:
    """Whether step ``step`` ends with a weight sync: the last step of a window, and the last
    step of the run (verl's fully-async trainer syncs once more at its end)."""
    return step % sync_interval(cfg) == 0 or step == total_steps


def at_frequency(cfg: MegarlConfig, step: int, freq: int) -> bool:
    """``trainer.test_freq`` / ``save_freq`` count weight versions (syncs) in verl's fully-async
    trainer: every ``freq`` syncs, i.e. every ``freq·K`` steps (``freq`` <= 0: never)."""
    return freq > 0 and step % (freq * sync_interval(cfg)) == 0


def describe_overlap(cfg: MegarlConfig) -> str:
    """How far the rollout ranks run ahead, in words (the console's start-up line)."""
    k, partial = sync_interval(cfg), partial_rollouts(cfg)
    if k > 1 or partial:
        return f"fully async, weights synced every {k} update(s)" + (
            ", partial rollouts" if partial else ""
        )
    ahead = extra_batches(cfg)  # K = 1: the steps asked ahead
    return {0: "on-policy", 1: "one step off"}.get(ahead, f"up to {ahead} steps off")
