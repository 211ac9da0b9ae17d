"""What the trainer runs today, checked without importing it (``megarl train``'s pre-flight)."""

from __future__ import annotations

from megarl.config import MegarlConfig


def unsupported_by_trainer(cfg: MegarlConfig) -> str | None:
    """Why the trainer cannot run ``cfg`` (a valid config), or None."""
    if cfg.reward_model.enable:
        return (
            "reward_model.enable=true: the trainer does not score with a learned reward model "
            "yet; use rule scorers or custom_reward_function"
        )
    return None
