"""What the trainer supplies to advantage estimators and policy losses, known before a run.

Each estimator and loss declares its inputs when it is registered (:mod:`megarl.algo.registry`);
:func:`unsupplied_inputs` compares a config's choice with the set below, so validation refuses
in one line an algorithm the trainer cannot feed. The trainer builds its calls from the same
names (:func:`policy_loss_settings`), and the registry's call refuses an input not supplied.
"""

from __future__ import annotations

from typing import Any

from megarl.config.batch_plan import ACTOR, critic_enabled
from megarl.config.schema import MegarlConfig

ADVANTAGE_INPUTS_ALWAYS = (
    "token_level_rewards",
    "response_mask",
    "index",
    "gamma",
    "lam",
    "norm_adv_by_std_in_grpo",
    "old_log_prob",
    "rollout_is_weights",  # None unless algorithm.rollout_correction.rollout_is is set
)
ADVANTAGE_INPUTS_WHEN = {
    "values": "the critic (critic.enable)",
    "sum_pi_squared": f"{ACTOR}.calculate_sum_pi_squared=true",
    "reward_baselines": "algorithm.adv_estimator=remax (the greedy responses' rewards)",
    "reward_components": "algorithm.adv_estimator=gdpo (the scorer's dict fields)",
    "gdpo_reward_keys": "algorithm.adv_estimator=gdpo",
    "gdpo_reward_weights": "algorithm.adv_estimator=gdpo",
}
"""Inputs the trainer supplies only under a setting, and that setting."""

POLICY_LOSS_BATCH_INPUTS = (
    "old_log_prob",
    "log_prob",
    "advantages",
    "response_mask",
    "loss_agg_mode",
    "rollout_is_weights",
    "global_token_count",
    "global_seq_count",
    "loss_scale_factor",
    "seq_token_counts",  # None: no sequence is split across context-parallel ranks
    "generator",  # a per-micro-batch torch.Generator, made only for a loss that declares it
)
"""Per micro-batch: the tensors, the aggregation inputs and a generator."""


def advantage_inputs(cfg: MegarlConfig) -> set[str]:
    """The names the trainer passes to `algorithm.adv_estimator` under `cfg`."""
    supplied = set(ADVANTAGE_INPUTS_ALWAYS)
    if critic_enabled(cfg):
        supplied.add("values")
    if cfg.actor_rollout_ref.actor.calculate_sum_pi_squared:
        supplied.add("sum_pi_squared")
    if cfg.algorithm.adv_estimator == "remax":
        supplied.add("reward_baselines")
    if cfg.algorithm.adv_estimator == "gdpo":
        supplied.update(("reward_components", "gdpo_reward_keys", "gdpo_reward_weights"))
    return supplied


def policy_loss_settings(cfg: MegarlConfig) -> dict[str, Any]:
    """The loss settings the trainer passes to every policy loss (each takes those it declares):
    the actor's clip ratios and SAPO temperatures, and every ``policy_loss.*`` key."""
    actor = cfg.actor_rollout_ref.actor
    loss = actor.policy_loss
    return {
        "clip_ratio": actor.clip_ratio,
        "clip_ratio_low": actor.clip_ratio_low,
        "clip_ratio_high": actor.clip_ratio_high,
        "clip_ratio_c": actor.clip_ratio_c,
        "tau_pos": actor.tau_pos,  # SAPO's temperatures live on the actor (verl's keys)
        "tau_neg": actor.tau_neg,
        **{key: getattr(loss, key) for key in vars(loss) if key != "loss_mode"},
    }


def unsupplied_inputs(cfg: MegarlConfig) -> list[str]:
    """One line per configured estimator or loss whose declared inputs the trainer does not
    supply under `cfg` (empty when both can run)."""
    from megarl.algo import ADV_ESTIMATORS, POLICY_LOSSES

    lines = []
    est = cfg.algorithm.adv_estimator
    missing = [k for k in ADV_ESTIMATORS.inputs(est) if k not in advantage_inputs(cfg)]
    if missing:
        how = "; ".join(f"{k} only with {ADVANTAGE_INPUTS_WHEN[k]}" for k in missing
                        if k in ADVANTAGE_INPUTS_WHEN)  # fmt: skip
        lines.append(
            f"algorithm.adv_estimator={est} needs {', '.join(missing)}, which the trainer "
            f"does not supply" + (f" ({how})" if how else "")
        )
    mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    supplied = set(POLICY_LOSS_BATCH_INPUTS) | set(policy_loss_settings(cfg))
    missing = [k for k in POLICY_LOSSES.inputs(mode) if k not in supplied]
    if missing:
        lines.append(
            f"{ACTOR}.policy_loss.loss_mode={mode} needs {', '.join(missing)}, which the "
            "trainer does not supply"
        )
    return lines
