"""What the trainer runs today, checked without importing it (``megarl train``'s pre-flight)."""

from __future__ import annotations

from megarl.config import MegarlConfig, critic_enabled


def unsupported_by_trainer(cfg: MegarlConfig) -> str | None:
    """Why the trainer cannot run ``cfg`` (a valid config), or None."""
    if critic_enabled(cfg):
        return (
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} with critic.enable="
            f"{cfg.critic.enable} needs a critic, which the trainer does not run yet (PPO with a "
            "critic is part 2): choose a critic-free estimator (grpo, rloo, reinforce_plus_plus, "
            "...) or set critic.enable=false"
        )
    if cfg.algorithm.adv_estimator == "remax":
        return "algorithm.adv_estimator=remax needs a greedy baseline rollout (trainer part 2)"
    if cfg.algorithm.use_kl_in_reward:
        return "algorithm.use_kl_in_reward=true is trainer part 2; use actor.use_kl_loss for now"
    if cfg.reward_model.enable:
        return "reward_model.enable=true (a learned reward model) is trainer part 2"
    return None
