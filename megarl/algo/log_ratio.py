"""The one log-space clamp megarl applies before turning a log-ratio into a ratio.

log(pi / pi_old) (or pi_old / pi_rollout, pi_ref / pi) is clamped to +-20 before `exp`:
exp(20) ~ 4.9e8, so one wild token cannot overflow the loss or a weight. verl clamps the same
way in its vanilla, CISPO, SAPO and DPPO losses, the rollout IS weights and the k3 estimator.
"""

from __future__ import annotations

import torch

LOG_RATIO_BOUND = 20.0


def clamp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """`log_ratio` clamped to [-20, 20] (any shape)."""
    return torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
