"""The PPO/GRPO trainer: one SPMD step from rollout to weight sync (``megarl.trainer.step``).

``main(cfg)`` runs a whole training job on this rank (``python -m megarl.train``).
"""

from __future__ import annotations

from typing import Any


def main(cfg: Any) -> int:
    """Train with the resolved config ``cfg``; returns the exit status."""
    from megarl.trainer.loop import main_entry

    return main_entry(cfg)


def preload() -> None:
    """Import what a rank's set-up needs (torch, Megatron, transformers' tokenizers; ~10 s), as
    ranks do while ``megarl train``'s pre-flight runs. No other effect."""
    from transformers import AutoTokenizer  # noqa: F401 -- the lazy module loads here

    import megarl.tracking
    import megarl.trainer.setup
    import megarl.trainer.step  # noqa: F401
