"""The PPO/GRPO trainer: one SPMD step from rollout to weight sync (``megarl.trainer.step``).

``main(cfg)`` runs a whole training job on this rank (``python -m megarl.train``).
"""

from __future__ import annotations

from typing import Any


def main(cfg: Any) -> int:
    """Train with the resolved config ``cfg``; returns the exit status."""
    from megarl.trainer.loop import main_entry

    return main_entry(cfg)
