"""Rewards: verl's rule scorers by data_source, user reward functions, the reward manager.

- :mod:`megarl.reward.scorers`: ``default_compute_score`` (verl 0.9.1's routing and semantics).
- :mod:`megarl.reward.loader`: ``ScorerSpec`` / ``load_scorer`` (``custom_reward_function``).
- :mod:`megarl.reward.manager`: ``RewardManager`` (exactly-once scoring over ranks, time limit,
  token-level rewards, metrics, dump), ``RewardInput``, ``RewardResult``, ``RewardError``.

Importing this package is cheap (no torch): scoring workers import it first.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RewardError", "RewardInput", "RewardManager", "RewardResult", "ScorerSpec"]


def __getattr__(name: str) -> Any:
    if name in ("RewardError", "RewardInput", "RewardManager", "RewardResult"):
        from megarl.reward import manager

        return getattr(manager, name)
    if name == "ScorerSpec":
        from megarl.reward.loader import ScorerSpec

        return ScorerSpec
    raise AttributeError(f"module 'megarl.reward' has no attribute {name!r}")
