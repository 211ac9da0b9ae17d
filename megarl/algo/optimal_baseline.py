"""Optimal token baseline (OTB): a per-token baseline from the group, weighted by path variance.

verl 0.9.1's `optimal_token_baseline` and its multi-turn `tir_` variant
(https://yingru.notion.site/The-Optimal-Token-Baseline-399211a558b782cfa936014c0d42dfb8). With
G_t the return-to-go, w_t = 1 - 2 pi(y_t) + sum_v pi(v)^2 (x rho_t^2 with rollout IS weights)
and W_t = sum_{valid j <= t} w_j, each position of a group gets the baseline
B = sum_i G_i W_i / (sum_i W_i + epsilon) over the group's responses, and advantage G - B on valid
tokens. The plain variant lines responses up by raw position, the tir variant by valid-token
index (tool output does not shift them). Unlike verl, a group of one response gets advantage 0.
"""

from __future__ import annotations

import torch

from megarl.algo.group_advantages import GroupIndex, group_ids
from megarl.algo.registry import ADV_ESTIMATORS
from megarl.algo.scan import exclusive_cumsum, reverse_cumsum

_F64 = torch.float64


def _zero_tail_cutoffs(
    ids: torch.Tensor, lengths: torch.Tensor, members: torch.Tensor, num_groups: int, T: int
) -> torch.Tensor:
    """`[B]` position from which a row's baseline is 0: the second-longest length of its group
    for a group's unique longest member, T + 1 (never) for every other row."""
    cutoffs = torch.full_like(lengths, T + 1)
    rows = torch.nonzero(members).squeeze(-1)
    sub_ids, sub_lengths = ids[rows], lengths[rows]
    by_length = torch.argsort(sub_lengths, descending=True, stable=True)
    order = by_length[torch.argsort(sub_ids[by_length], stable=True)]
    count = torch.bincount(sub_ids, minlength=num_groups)
    starts = (torch.cumsum(count, 0) - count)[count >= 2]
    longest, second = order[starts], order[starts + 1]
    unique = sub_lengths[longest] > sub_lengths[second]
    cutoffs[rows[longest[unique]]] = sub_lengths[second[unique]]
    return cutoffs


def _token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    old_log_prob: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
    handle_zero_tail: bool,
    epsilon: float,
    by_valid_token: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    mask = response_mask.bool()
    B, T = mask.shape
    returns = reverse_cumsum(torch.where(mask, token_level_rewards.to(_F64), 0.0))
    w = 1.0 - 2.0 * torch.exp(old_log_prob.to(_F64)) + sum_pi_squared.to(_F64)
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.to(_F64).square()
    W = torch.cumsum(torch.where(mask, w, 0.0), dim=-1)

    ids, num_groups = group_ids(index, device=mask.device)
    if ids.numel() != B:
        raise ValueError(f"index has {ids.numel()} entries for {B} responses")
    lengths = mask.sum(dim=-1)
    members = lengths > 0 if by_valid_token else torch.ones_like(lengths, dtype=torch.bool)
    group_size = torch.bincount(ids[members], minlength=num_groups)[ids]
    if by_valid_token:
        position = exclusive_cumsum(mask)
    else:
        position = torch.arange(T, device=mask.device).expand(B, T)
    key = ids.unsqueeze(-1) * T + position  # (group, position) cell of every token
    cell = key[mask]
    numerator = torch.zeros(num_groups * T, dtype=_F64, device=mask.device)
    denominator = torch.zeros_like(numerator)
    numerator.index_add_(0, cell, (returns * W)[mask])
    denominator.index_add_(0, cell, W[mask])
    baseline = torch.zeros_like(returns)
    baseline[mask] = numerator[cell] / (denominator[cell] + epsilon)
    if handle_zero_tail:
        cutoffs = _zero_tail_cutoffs(ids, lengths, members, num_groups, T)
        baseline = torch.where(position >= cutoffs.unsqueeze(-1), 0.0, baseline)
    keep = mask & (group_size >= 2).unsqueeze(-1)
    advantages = torch.where(keep, returns - baseline, 0.0)
    dtype = token_level_rewards.dtype
    return advantages.to(dtype), returns.to(dtype)


# What the trainer passes (as verl's compute_advantage does for these two): the rollout IS
# weights are None unless algorithm.rollout_correction.rollout_is is set.
_OTB_INPUTS = (
    "token_level_rewards",
    "response_mask",
    "index",
    "old_log_prob",
    "sum_pi_squared",
    "rollout_is_weights",
)


@ADV_ESTIMATORS.register("optimal_token_baseline", inputs=_OTB_INPUTS)
@torch.no_grad()
def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    old_log_prob: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB with responses lined up by raw position (see the module docstring).

    Args:
        token_level_rewards, response_mask: `[B, T]`.
        index: `[B]` group labels.
        old_log_prob: `[B, T]` log pi(y_t) of the rollout's tokens (verl calls it old_log_probs).
        sum_pi_squared: `[B, T]` sum_v pi(v)^2 at each position, from the actor's log-prob pass
            over the full vocab-parallel distribution (`vocab_parallel_sum_pi_squared` in
            `megarl.models.logprobs`; verl: `actor.calculate_sum_pi_squared`).
        rollout_is_weights: optional `[B, T]` truncated IS weights rho (W uses rho^2).
        handle_zero_tail: zero the baseline of a group's unique longest response past the
            second-longest length (verl 0.9.1's default: True).
        epsilon: added to the denominator.

    Returns:
        advantages `[B, T]` (0 at masked positions and in groups of one), returns G `[B, T]`.
    """
    return _token_baseline_advantage(
        token_level_rewards,
        response_mask,
        index,
        old_log_prob,
        sum_pi_squared,
        rollout_is_weights,
        handle_zero_tail,
        epsilon,
        by_valid_token=False,
    )


@ADV_ESTIMATORS.register("tir_optimal_token_baseline", inputs=_OTB_INPUTS)
@torch.no_grad()
def compute_tir_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    old_log_prob: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB for multi-turn / tool-integrated responses: lined up by valid-token index, empty
    responses left out of their group (see the module docstring). Arguments and returns as
    `compute_optimal_token_baseline_advantage`."""
    return _token_baseline_advantage(
        token_level_rewards,
        response_mask,
        index,
        old_log_prob,
        sum_pi_squared,
        rollout_is_weights,
        handle_zero_tail,
        epsilon,
        by_valid_token=True,
    )
