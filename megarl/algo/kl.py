"""KL estimators, KL in the reward (fixed / adaptive controller) and KL as a loss term.

Estimators of KL(pi || pi_ref) from log-probs of tokens sampled from pi (J. Schulman,
http://joschu.net/blog/kl-approx.html), by config name, with d = log_prob - ref_log_prob:
kl / k1: d;  abs: |d|;  mse / k2: 0.5 d^2;  low_var_kl / k3: r - log r - 1 with r = exp(-d);
full: exact KL from `[B, T, V]` log-softmax inputs. "<name>+" has the value of <name> and the
gradient of k2, the unbiased KL gradient ("mse+" and "k2+" are k2 itself, as in verl).
Every estimator returns `[B, T]` and none masks: pass the mask to `agg_loss` or multiply.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from megarl.algo.aggregation import agg_loss
from megarl.algo.log_ratio import clamp_log_ratio
from megarl.algo.masked import masked_mean
from megarl.algo.registry import KL_ESTIMATORS

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@KL_ESTIMATORS.register("kl", "k1")
def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log pi_ref, `[B, T]`."""
    return log_prob - ref_log_prob


@KL_ESTIMATORS.register("abs")
def kl_abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """|log pi - log pi_ref|, `[B, T]`."""
    return (log_prob - ref_log_prob).abs()


@KL_ESTIMATORS.register("mse", "k2", "mse+", "k2+")
def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 (log pi - log pi_ref)^2, `[B, T]`."""
    return 0.5 * (log_prob - ref_log_prob).square()


@KL_ESTIMATORS.register("low_var_kl", "k3")
def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k3 = r - log r - 1, r = pi_ref / pi, log r clamped to +-20, result to [-10, 10]; `[B, T]`.

    As verl's implementation; some write-ups put the ratio the other way round (pi / pi_ref).
    """
    log_r = clamp_log_ratio(ref_log_prob - log_prob)
    return torch.clamp(torch.exp(log_r) - log_r - 1.0, -10.0, 10.0)


@KL_ESTIMATORS.register("full")
def kl_full(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """Exact KL per position from full log-distributions `[B, T, V]` → `[B, T]`.

    verl raises NotImplementedError here. With a vocab-parallel (TP) layout each rank holds part
    of V: the caller must all-reduce the sum.
    """
    if log_prob.dim() < 3 or log_prob.shape != ref_log_prob.shape:
        raise ValueError(
            "kl_penalty 'full' needs full log-softmax distributions [B, T, V] for both policies, "
            f"got {tuple(log_prob.shape)} and {tuple(ref_log_prob.shape)}"
        )
    return (torch.exp(log_prob) * (log_prob - ref_log_prob)).sum(dim=-1)


def _straight_through(estimator: KLEstimator) -> KLEstimator:
    def estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
        value = estimator(log_prob, ref_log_prob)
        grad_path = kl_k2(log_prob, ref_log_prob)
        return grad_path - grad_path.detach() + value.detach()

    estimate.__doc__ = f"Value of {estimator.__name__}, gradient of k2 (straight-through)."
    return estimate


for _name, _fn in (
    ("kl", kl_k1),
    ("k1", kl_k1),
    ("abs", kl_abs),
    ("low_var_kl", kl_k3),
    ("k3", kl_k3),
):
    KL_ESTIMATORS.register(_name + "+")(_straight_through(_fn))


def kl_penalty(
    log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_penalty: str = "kl"
) -> torch.Tensor:
    """KL estimate `[B, T]` by estimator name (see module docstring)."""
    return KL_ESTIMATORS.get(kl_penalty)(log_prob, ref_log_prob)


class FixedKLController:
    """`algorithm.kl_ctrl.type=fixed`: the coefficient stays `kl_coef`."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op."""


class AdaptiveKLController:
    """`algorithm.kl_ctrl.type=adaptive` (Ziegler et al., arXiv:1909.08593).

    After each batch: e = clip(current_kl / target_kl - 1, -0.2, 0.2);
    value *= 1 + e * n_steps / horizon (n_steps: responses in the batch).
    """

    def __init__(self, kl_coef: float, target_kl: float, horizon: float) -> None:
        if horizon <= 0:
            raise ValueError(f"kl_ctrl.horizon must be > 0, got {horizon}")
        if target_kl <= 0:
            raise ValueError(f"kl_ctrl.target_kl must be > 0, got {target_kl}")
        self.value = float(kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient towards keeping the KL at `target_kl`."""
        error = float(np.clip(float(current_kl) / self.target - 1.0, -0.2, 0.2))
        self.value *= 1.0 + error * n_steps / self.horizon


KL_CONTROLLER_TYPES = ("fixed", "adaptive")


def get_kl_controller(
    type: str = "fixed",
    kl_coef: float = 0.001,
    target_kl: float | None = None,
    horizon: float | None = None,
) -> FixedKLController | AdaptiveKLController:
    """Controller from the `algorithm.kl_ctrl.{type,kl_coef,target_kl,horizon}` values."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("kl_ctrl.type=adaptive needs kl_ctrl.target_kl and kl_ctrl.horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(
        f"unknown kl_ctrl.type {type!r}; valid names: " + ", ".join(KL_CONTROLLER_TYPES)
    )


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL in the reward (`algorithm.use_kl_in_reward`): r = score - kl_coef * KL(pi_old || pi_ref).

    Args:
        token_level_scores: `[B, T]` rewards before the penalty.
        old_log_prob, ref_log_prob: `[B, T]` log-probs of the rollout policy and the reference.
        response_mask: `[B, T]` binary; the penalty is 0 at masked positions.
        kl_coef: the controller's current value.
        kl_penalty: estimator name (`algorithm.kl_penalty`).

    Returns:
        token_level_rewards `[B, T]`, current_kl (0-dim: per-sequence masked mean, averaged over
        sequences, as verl) — feed `current_kl.item()` and B to the controller's `update`.
    """
    mask = response_mask.to(token_level_scores.dtype)
    kld = KL_ESTIMATORS.get(kl_penalty)(old_log_prob, ref_log_prob) * mask
    rewards = token_level_scores - kl_coef * kld
    current_kl = masked_mean(kld, mask, dim=-1).mean()
    return rewards, current_kl


def compute_kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_loss_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    global_token_count: torch.Tensor | float | None = None,
    global_seq_count: torch.Tensor | float | None = None,
    loss_scale_factor: float | None = None,
    seq_token_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """KL as a loss term (`actor.use_kl_loss`): agg(KL(pi_theta || pi_ref)); the actor adds
    kl_loss_coef * this. Shapes `[B, T]` (`[B, T, V]` log-probs for "full")."""
    return agg_loss(
        KL_ESTIMATORS.get(kl_loss_type)(log_prob, ref_log_prob),
        response_mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        loss_scale_factor=loss_scale_factor,
        seq_token_counts=seq_token_counts,
    )
