"""What a resumed run needs besides model and optimizer state (saved with every checkpoint)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TrainerState:
    """The trainer's own state, identical on every rank."""

    step: int = 0
    """Trainer steps completed."""
    sampler: dict[str, Any] = field(default_factory=dict)
    """``GlobalBatchSampler.state_dict()`` after the last completed step."""
    kl_coef: float | None = None
    """The KL-in-reward controller's current coefficient (the adaptive one changes it each step;
    a resume must continue from it, not from algorithm.kl_ctrl.kl_coef)."""
    tracking_run_id: str | None = None
    """The MLflow run id, so a resumed run logs into the same run."""
    consecutive_skips: int = 0
    """Optimizer steps skipped in a row for a non-finite gradient."""

    def save_kl_coef(self, kl_ctrl: Any) -> None:
        """Record the KL-in-reward controller's coefficient (None without one)."""
        self.kl_coef = None if kl_ctrl is None else float(kl_ctrl.value)

    def restore_kl_coef(self, kl_ctrl: Any) -> None:
        """Give a freshly built controller the saved coefficient, if one was saved."""
        if kl_ctrl is not None and self.kl_coef is not None:
            kl_ctrl.value = float(self.kl_coef)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerState:
        return cls(**data)


def actor_trains(step: int, critic_warmup: int) -> bool:
    """Whether trainer step ``step`` (counted from 1) updates the actor: verl's
    ``critic_warmup <= global_steps``, so the critic trains alone for steps 1..critic_warmup-1
    (critic_warmup 0 and 1 both mean no warm-up, as in verl)."""
    return step >= critic_warmup
