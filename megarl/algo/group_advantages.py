"""Outcome-reward advantage estimators over groups of responses to the same prompt.

A response's score is the sum of its token-level rewards; `index` names each response's group.
Every estimator is vectorized over groups, computes group statistics in float64 (unbiased std,
as verl's `torch.std`) and returns `(advantages, returns)`: the same `[B, T]` tensor twice, as in
verl, with the per-response scalar broadcast over the response mask. Unlike verl, a group of one
response gets advantage 0 in every estimator (verl gives it a value derived from its score, or
raises in grpo_passk).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np
import torch

from megarl.algo.masked import masked_whiten
from megarl.algo.registry import ADV_ESTIMATORS

_F64 = torch.float64
GroupIndex = torch.Tensor | np.ndarray | Sequence[Hashable]


def group_ids(index: GroupIndex, device: torch.device | None = None) -> tuple[torch.Tensor, int]:
    """Map a group label per response to dense ids 0..G-1.

    Args:
        index: `[B]` labels: an integer tensor or array, or a sequence of hashables (e.g. uuids).

    Returns:
        (ids int64 `[B]`, G). Equal labels get equal ids.
    """
    if isinstance(index, torch.Tensor):
        _, ids = torch.unique(index.flatten(), return_inverse=True)
    elif isinstance(index, np.ndarray) and index.dtype.kind in "iub":
        ids = torch.from_numpy(np.unique(index.reshape(-1), return_inverse=True)[1].reshape(-1))
    else:
        table: dict[Hashable, int] = {}
        ids = torch.tensor(
            [table.setdefault(label, len(table)) for label in index], dtype=torch.int64
        )
    ids = ids.to(device=device, dtype=torch.int64)
    return ids, int(ids.max().item()) + 1 if ids.numel() else 0


class GroupStats:
    """Per-group count, mean and unbiased std of `[B]` scores (float64), gathered back per response."""

    def __init__(self, scores: torch.Tensor, index: GroupIndex) -> None:
        self.scores = scores.to(_F64)
        self.ids, num_groups = group_ids(index, device=scores.device)
        if self.ids.numel() != self.scores.numel():
            raise ValueError(
                f"index has {self.ids.numel()} entries for {self.scores.numel()} responses"
            )
        self.num_groups = num_groups
        count = torch.bincount(self.ids, minlength=num_groups)
        self.group_count = count
        self.count = count[self.ids].to(_F64)  # [B]: size of each response's group
        total = self._sum(self.scores)
        self.total = total[self.ids]
        self.mean = self.total / self.count
        sq_dev = self._sum((self.scores - self.mean) ** 2)[self.ids]
        self.std = torch.sqrt(sq_dev / (self.count - 1).clamp(min=1))
        self.in_group = self.count > 1  # a group of one yields advantage 0

    def _sum(self, per_response: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.num_groups, dtype=per_response.dtype, device=per_response.device)
        return out.index_add_(0, self.ids, per_response)

    def group_sum(self, per_response: torch.Tensor) -> torch.Tensor:
        """`[B]`: sum of `per_response` over each response's group."""
        return self._sum(per_response.to(_F64))[self.ids]


def _broadcast(
    scalars: torch.Tensor, stats: GroupStats, response_mask: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    scalars = torch.where(stats.in_group, scalars, 0.0).to(dtype)
    # One pass over [B, T] whatever the mask's dtype (bool, int64, float): the product promotes
    # to `dtype` inside the kernel, no separate conversion of the mask.
    advantages = scalars.unsqueeze(-1) * response_mask
    if advantages.dtype != dtype:  # a float64 mask with float32 rewards
        advantages = advantages.to(dtype)
    return advantages, advantages


@ADV_ESTIMATORS.register(
    "grpo", inputs=("token_level_rewards", "response_mask", "index", "norm_adv_by_std_in_grpo")
)
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: (score - group mean) / (group std + epsilon); without the std (Dr.GRPO) if
    `norm_adv_by_std_in_grpo` is False. Shapes: rewards/mask `[B, T]`, index `[B]`."""
    stats = GroupStats(token_level_rewards.sum(dim=-1), index)
    centered = stats.scores - stats.mean
    scalars = centered / (stats.std + epsilon) if norm_adv_by_std_in_grpo else centered
    return _broadcast(scalars, stats, response_mask, token_level_rewards.dtype)


@ADV_ESTIMATORS.register("rloo", inputs=("token_level_rewards", "response_mask", "index"))
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (arXiv:2402.14740): score minus the mean of the other n-1 scores, (sum - r_i)/(n-1)."""
    stats = GroupStats(token_level_rewards.sum(dim=-1), index)
    baseline = (stats.total - stats.scores) / (stats.count - 1).clamp(min=1)
    return _broadcast(stats.scores - baseline, stats, response_mask, token_level_rewards.dtype)


@ADV_ESTIMATORS.register(
    "reinforce_plus_plus_baseline", inputs=("token_level_rewards", "response_mask", "index")
)
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: score minus group mean, broadcast over tokens, whitened over the batch.

    Responses in groups of one are left out of the whitening statistics and get 0.
    """
    stats = GroupStats(token_level_rewards.sum(dim=-1), index)
    mask = response_mask.bool() & stats.in_group.unsqueeze(-1)
    centered = (stats.scores - stats.mean).unsqueeze(-1) * mask
    advantages = (masked_whiten(centered, mask) * mask).to(token_level_rewards.dtype)
    return advantages, advantages


@ADV_ESTIMATORS.register("opo", inputs=("token_level_rewards", "response_mask", "index"))
@torch.no_grad()
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (arXiv:2505.23585): score minus the length-weighted group mean sum(l_j r_j)/sum(l_j),
    with l_j the number of response tokens. A group whose lengths are all 0 gets baseline 0."""
    stats = GroupStats(token_level_rewards.sum(dim=-1), index)
    lengths = response_mask.to(_F64).sum(dim=-1)
    weighted = stats.group_sum(lengths * stats.scores)
    total_length = stats.group_sum(lengths)
    baseline = torch.where(total_length > 0, weighted / total_length.clamp(min=1e-30), 0.0)
    return _broadcast(stats.scores - baseline, stats, response_mask, token_level_rewards.dtype)


@ADV_ESTIMATORS.register("gpg", inputs=("token_level_rewards", "response_mask", "index"))
@torch.no_grad()
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    f_norm: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: alpha * (score - group mean) / f_norm, alpha = B / #(non-zero scores in the batch)."""
    scores = token_level_rewards.sum(dim=-1)
    stats = GroupStats(scores, index)
    alpha = scores.numel() / max(int(torch.count_nonzero(scores).item()), 1)
    scalars = alpha * (stats.scores - stats.mean) / f_norm
    return _broadcast(scalars, stats, response_mask, token_level_rewards.dtype)


@ADV_ESTIMATORS.register(
    "grpo_passk",
    inputs=("token_level_rewards", "response_mask", "index", "norm_adv_by_std_in_grpo"),
)
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO (arXiv:2503.19595): only each group's best response gets a non-zero advantage,
    r_max - r_second_max (divided by group std + epsilon if `norm_adv_by_std_in_grpo`).

    Ties for the maximum give 0 whichever response is picked. Groups of one get 0 (verl raises).
    """
    stats = GroupStats(token_level_rewards.sum(dim=-1), index)
    # Sort by (group id, score descending): the first two entries of each group are max, second max.
    by_score = torch.argsort(stats.scores, descending=True, stable=True)
    order = by_score[torch.argsort(stats.ids[by_score], stable=True)]
    starts = torch.cumsum(stats.group_count, 0) - stats.group_count
    starts = starts[stats.group_count > 1]
    best = order[starts]
    second = order[starts + 1]
    gap = stats.scores[best] - stats.scores[second]
    if norm_adv_by_std_in_grpo:
        gap = gap / (stats.std[best] + epsilon)
    scalars = torch.zeros_like(stats.scores).index_put_((best,), gap)
    return _broadcast(scalars, stats, response_mask, token_level_rewards.dtype)


@ADV_ESTIMATORS.register(
    "gdpo",
    inputs=("token_level_rewards", "response_mask", "index", "norm_adv_by_std_in_grpo",
            "reward_components", "gdpo_reward_keys", "gdpo_reward_weights"),
)  # fmt: skip
@torch.no_grad()
def compute_gdpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    reward_components: Mapping[str, torch.Tensor] | None = None,
    gdpo_reward_keys: Sequence[str] | None = None,
    gdpo_reward_weights: Sequence[float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (arXiv:2601.05242): normalise each reward component within its group, then combine.

        A_k  = GRPO advantage of component k alone: (r_k - group mean) / (group std + epsilon)
               (without the std if `norm_adv_by_std_in_grpo` is False)
        A    = sum_k w_k A_k, broadcast over the response tokens
        adv  = masked_whiten(A, mask) * mask       (whitened over the batch's valid tokens)
    A dominant reward no longer drowns the others, as it would in GRPO on their sum. With no
    `gdpo_reward_keys` it falls back to one component, `token_level_rewards` (GRPO + whitening),
    as verl does without the key list.

    Groups of one get advantage 0 (megarl's rule) and stay out of the whitening statistics (verl:
    score / (1 + epsilon) per component, whitened with the rest).

    Args:
        token_level_rewards: `[B, T]`, the single-reward fallback.
        response_mask: `[B, T]` binary.
        index: `[B]` group labels.
        epsilon, norm_adv_by_std_in_grpo: as for grpo.
        reward_components: name -> `[B]` score of that component per response (or `[B, T]`
            token rewards, summed over T); verl takes them from compute_score's returned dict.
        gdpo_reward_keys: `algorithm.gdpo_reward_keys`, which components to use, in order.
        gdpo_reward_weights: `algorithm.gdpo_reward_weights`, one weight per key (default 1).

    Returns:
        (advantages, advantages), `[B, T]` in the dtype of `token_level_rewards`.
    """
    if gdpo_reward_keys:
        components = reward_components or {}
        missing = [key for key in gdpo_reward_keys if key not in components]
        if missing:
            raise ValueError(
                f"gdpo_reward_keys {missing} not among the reward components "
                f"({', '.join(components) or 'none given'})"
            )
        scores = [components[key] for key in gdpo_reward_keys]
        scores = [s.sum(dim=-1) if s.dim() == 2 else s for s in scores]
    else:
        scores = [token_level_rewards.sum(dim=-1)]
    weights = [1.0] * len(scores) if gdpo_reward_weights is None else list(gdpo_reward_weights)
    if len(weights) != len(scores):
        raise ValueError(
            f"gdpo_reward_weights has {len(weights)} entries for {len(scores)} gdpo_reward_keys"
        )
    combined = None
    for weight, score in zip(weights, scores, strict=True):
        stats = GroupStats(score.to(token_level_rewards.device), index)
        centered = stats.scores - stats.mean
        scalar = centered / (stats.std + epsilon) if norm_adv_by_std_in_grpo else centered
        combined = weight * scalar if combined is None else combined + weight * scalar
    mask = response_mask.bool() & stats.in_group.unsqueeze(-1)
    advantages = combined.unsqueeze(-1) * mask
    advantages = (masked_whiten(advantages, mask) * mask).to(token_level_rewards.dtype)
    return advantages, advantages
