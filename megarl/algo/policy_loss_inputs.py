"""What every policy loss takes, declared once: the `[B, T]` tensors and the aggregation inputs.

A loss is a function of `PolicyLossInputs` and its own settings (clip ratios, tau, ...),
registered with `@policy_loss(name, settings=(...))`; a loss that forces its aggregation (sapo,
geo_mean) names in `takes` only the aggregation inputs it uses. The registered `PolicyLoss` is
called flat, by keyword or (the tensors) by position:

    old_log_prob, log_prob, advantages, response_mask, <aggregation inputs>, <settings>

Its `inputs` are what `POLICY_LOSSES.call` passes and what config validation checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.algo.aggregation import agg_loss
from megarl.algo.log_ratio import clamp_log_ratio
from megarl.algo.masked import masked_mean
from megarl.algo.registry import POLICY_LOSSES

Counts = torch.Tensor | float | None
LossAndMetrics = tuple[torch.Tensor, dict[str, torch.Tensor]]


@dataclass(frozen=True)
class PolicyLossInputs:
    """The inputs every policy loss shares: `[B, T]` tensors and how the loss is aggregated."""

    old_log_prob: torch.Tensor
    """`[B, T]` log-probs of the proximal policy (recomputed old log-probs in decoupled mode,
    rollout log-probs in bypass mode; see `rollout_correction.py`)."""
    log_prob: torch.Tensor
    """`[B, T]` log-probs of the policy being trained (carries the gradient)."""
    advantages: torch.Tensor
    """`[B, T]` advantages."""
    response_mask: torch.Tensor
    """`[B, T]` binary mask of the response tokens."""
    loss_agg_mode: str = "token-mean"
    """One of `LOSS_AGG_MODES` (see `agg_loss`)."""
    rollout_is_weights: torch.Tensor | None = None
    """Optional `[B, T]` truncated importance weights pi_old / pi_rollout (detached) multiplying
    the per-token loss (decoupled mode's rollout correction)."""
    global_token_count: Counts = None
    """N_tok over the whole mini-batch (see `agg_loss`)."""
    global_seq_count: Counts = None
    """N_seq over the whole mini-batch (see `agg_loss`)."""
    loss_scale_factor: float | None = None
    """Divisor of seq-mean-token-sum-norm (see `agg_loss`)."""
    seq_token_counts: torch.Tensor | None = None
    """`[B]` valid tokens of each whole sequence, under context parallelism (see `agg_loss`)."""

    def log_ratio(self) -> torch.Tensor:
        """`[B, T]` log(pi / pi_old), clamped to +-20 (`clamp_log_ratio`)."""
        return clamp_log_ratio(self.log_prob - self.old_log_prob)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean of `[B, T]` values over the response mask (0 when it is empty)."""
        return masked_mean(values, self.response_mask)

    def aggregate(self, pg_losses: torch.Tensor, loss_agg_mode: str | None = None) -> torch.Tensor:
        """`[B, T]` per-token losses times the rollout IS weights (if any), aggregated by
        `agg_loss` with `loss_agg_mode` when the loss forces one, else with this batch's."""
        if self.rollout_is_weights is not None:
            pg_losses = pg_losses * self.rollout_is_weights
        return agg_loss(
            pg_losses,
            self.response_mask,
            loss_agg_mode or self.loss_agg_mode,
            global_token_count=self.global_token_count,
            global_seq_count=self.global_seq_count,
            loss_scale_factor=self.loss_scale_factor,
            seq_token_counts=self.seq_token_counts,
        )


TENSORS = ("old_log_prob", "log_prob", "advantages", "response_mask")
AGGREGATION = (
    "loss_agg_mode",
    "rollout_is_weights",
    "global_token_count",
    "global_seq_count",
    "loss_scale_factor",
    "seq_token_counts",
)


class PolicyLoss:
    """A registered policy loss: `body(PolicyLossInputs, **settings)` with its declared inputs."""

    def __init__(
        self,
        body: Callable[..., LossAndMetrics],
        settings: tuple[str, ...],
        takes: tuple[str, ...],
    ) -> None:
        self.body = body
        self.settings = settings
        self.takes = takes
        self.inputs = (*TENSORS, *takes, *settings)
        """Every keyword input, in the order of the flat call."""
        self.__name__ = self.__qualname__ = body.__name__
        self.__doc__ = body.__doc__
        self.__module__ = body.__module__

    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        **named: object,
    ) -> LossAndMetrics:
        """`(loss, metrics)`; an input this loss did not declare is a TypeError naming it."""
        unknown = sorted(set(named) - set(self.takes) - set(self.settings))
        if unknown:
            raise TypeError(f"{self.__name__} takes no {', '.join(unknown)}")
        shared = {key: named.pop(key) for key in self.takes if key in named}
        inputs = PolicyLossInputs(old_log_prob, log_prob, advantages, response_mask, **shared)
        return self.body(inputs, **named)  # type: ignore[arg-type]


def policy_loss(
    *names: str, settings: tuple[str, ...] = (), takes: tuple[str, ...] = AGGREGATION
) -> Callable[[Callable[..., LossAndMetrics]], PolicyLoss]:
    """Register `body(inputs, **settings)` in `POLICY_LOSSES` under `names` as a `PolicyLoss`
    taking the four tensors, the aggregation inputs in `takes` and the `settings` named (the
    parameters of `body` after `inputs`; their defaults are `body`'s)."""
    unknown = set(takes) - set(AGGREGATION)
    if unknown:
        raise ValueError(f"not aggregation inputs: {sorted(unknown)}")

    def decorator(body: Callable[..., LossAndMetrics]) -> PolicyLoss:
        loss = PolicyLoss(body, tuple(settings), tuple(takes))
        POLICY_LOSSES.register(*names, inputs=loss.inputs)(loss)
        return loss

    return decorator


def clip_bounds(
    clip_ratio: float, clip_ratio_low: float | None, clip_ratio_high: float | None
) -> tuple[float, float]:
    """(low, high): `clip_ratio_low/high`, each defaulting to `clip_ratio`."""
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    return low, high
