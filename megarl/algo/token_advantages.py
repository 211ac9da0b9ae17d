"""Token-level advantage estimators: GAE (PPO), REINFORCE++ and ReMax.

Every estimator takes `[B, T]` tensors over the response tokens and returns `(advantages, returns)`,
both `[B, T]` in the dtype of the inputs. Masks are binary (bool or 0/1). All of them run under
`torch.no_grad()`; nothing here loops over time steps (see `scan.py`).
"""

from __future__ import annotations

import torch

from megarl.algo.masked import masked_whiten
from megarl.algo.registry import ADV_ESTIMATORS
from megarl.algo.scan import (
    discounted_reverse_cumsum,
    exclusive_cumsum,
    reverse_cumsum,
    reversed_discounted_cumsum_,
)

_F64 = torch.float64


def _check_unit_interval(**params: float) -> None:
    for name, value in params.items():
        if not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"{name} must lie in [0, 1], got {value}")


@ADV_ESTIMATORS.register("gae")
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation with masked steps, as verl's per-step recurrence.

    Going backwards over t, with `nextvalues` and `lastgaelam` starting at 0:
        delta[t]  = r[t] + gamma * nextvalues - V[t]
        A[t]      = delta[t] + gamma * lam * lastgaelam        (valid t)
        nextvalues, lastgaelam = V[t], A[t]                    (valid t only)
    At a masked step nothing is updated and A[t] holds the running `lastgaelam`, i.e. the advantage
    of the next valid position (0 after the last one). The seeds (003, §2.5) write 0 there instead;
    megarl keeps verl's numbers, and masked positions never reach a loss (every aggregation masks).
    Rewards at masked positions are ignored, exactly as in the recurrence.

    Computed in float64 without a loop over time: the valid tokens of each row are packed to the
    left (a scatter; free for right-padded rows), where the recurrence is plain GAE solved by a
    weighted cumulative sum on time-reversed rows (`scan.py`), and unpacked with one gather. Whitening statistics come from the
    packed advantages (masked mean and unbiased variance over the valid tokens, as masked_whiten).

    Args:
        token_level_rewards: `[B, T]` rewards per response token.
        values: `[B, T]` critic values V(s_t).
        response_mask: `[B, T]` 1 for response tokens that count, 0 otherwise (anywhere in the row).
        gamma: discount factor (`algorithm.gamma`), in [0, 1].
        lam: GAE lambda (`algorithm.lam`), in [0, 1].
        whiten: whiten the advantages over the mask (verl always does).

    Returns:
        advantages `[B, T]` (whitened if `whiten`), returns `[B, T]` = raw advantages + values.
    """
    _check_unit_interval(gamma=gamma, lam=lam)
    gamma, lam = float(gamma), float(lam)
    length = response_mask.shape[1]
    if length == 0:
        return torch.zeros_like(values), values.clone()
    lengths, packed = _lengths_and_packed(response_mask)
    # Large float64 buffers dominate the cost on CPU: every new one is faulted in page by page.
    # The code below keeps at most three alive at a time and works in place where it can.
    v = values.to(_F64, copy=True)  # converted once (mixed-dtype ops would convert each time)
    delta = token_level_rewards.to(_F64, copy=True).sub_(v)  # r[t] - V[t]
    if packed:
        # Right-padded rows: the valid tokens already sit in their slots.
        position = None
        delta[:, :-1].add_(v[:, 1:], alpha=gamma)
        # The last valid token of a row has no next value: recompute its delta without one.
        last = (lengths - 1).clamp(min=0).unsqueeze(-1)
        exact = token_level_rewards.gather(1, last).to(_F64) - v.gather(1, last)
        has_next = ((lengths > 0) & (lengths < length)).unsqueeze(-1)
        delta.scatter_(1, last, torch.where(has_next, exact, delta.gather(1, last)))
        padding = torch.arange(length, device=lengths.device) >= lengths.unsqueeze(-1)
        delta.masked_fill_(padding, 0.0)
    else:
        # Pack the valid tokens of each row to the left ("slots"); there the recurrence is plain
        # GAE whose next value is the next slot's value. Valid t goes to its own slot, masked t
        # points at the slot of the next valid token (n_valid if none).
        mask = response_mask.bool()
        position = exclusive_cumsum(mask)
        masked_out = ~mask
        delta = _pack(delta.masked_fill_(masked_out, 0.0), position)
        value_slots = _pack(v.masked_fill(masked_out, 0.0), position)
        delta[:, :-1].add_(value_slots[:, 1:], alpha=gamma)  # slots past the last hold 0
        del value_slots
    reversed_deltas = delta.flip(-1)
    del delta  # free before the next allocation (see the note above)
    slot_advantages = reversed_discounted_cumsum_(reversed_deltas, gamma * lam).flip(-1)
    del reversed_deltas
    # Unpacking gives masked t the advantage of the next valid token, 0 after the last: verl's
    # carried `lastgaelam`. Slots past the last valid token hold exactly 0.
    if position is None:
        advantages = slot_advantages
    else:
        advantages = slot_advantages.gather(1, position)
    if whiten:
        # Masked mean and unbiased variance over the valid tokens, from the slots (empty slots
        # are exactly 0, so plain sums over all slots are sums over valid tokens).
        count = lengths.sum().to(_F64)
        flat = slot_advantages.reshape(-1)
        mean = flat.sum() / count.clamp(min=1)
        sum_sq = torch.dot(flat, flat) - count * mean * mean
        var = torch.where(count > 1, sum_sq.clamp(min=0) / (count - 1).clamp(min=1), 0.0)
    returns = v.add_(advantages).to(values.dtype)
    if whiten:
        advantages = advantages.sub_(mean).mul_(torch.rsqrt(var + 1e-8))
    return advantages.to(values.dtype), returns


def _lengths_and_packed(response_mask: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Valid tokens per row (int64 `[B]`) and whether every row is right-padded (1...1 0...0)."""
    length = response_mask.shape[1]
    if response_mask.is_floating_point():
        # Cheap on a float mask: a row is right-padded iff its first 0 sits at index n_valid
        # (argmin returns the first minimum), or it has no 0 at all.
        lengths = response_mask.sum(dim=-1).round().long()
        first_zero = response_mask.argmin(dim=-1)
        return lengths, bool(((first_zero == lengths) | (lengths == length)).all())
    mask = response_mask.bool()
    packed = length < 2 or bool((mask[:, 1:] <= mask[:, :-1]).all())
    return mask.sum(dim=-1), packed


def _pack(x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """`[B, T+1]`: entries of x (zero where masked) moved to slot `position`; 0 past the last."""
    slots = torch.zeros(x.shape[0], x.shape[1] + 1, dtype=x.dtype, device=x.device)
    return slots.scatter_add_(1, position, x)


@ADV_ESTIMATORS.register("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (arXiv:2501.03262): discounted returns, whitened over the batch.

    returns[t] = r[t] + gamma * mask[t+1] * returns[t+1] — the running return is reset at every
    masked position (verl: "reset after EOS"), so a masked step cuts what flows to earlier tokens.
    advantages = masked_whiten(returns, mask) * mask.

    Args:
        token_level_rewards, response_mask: `[B, T]`.
        gamma: discount (`algorithm.gamma`), in [0, 1].

    Returns:
        advantages `[B, T]` (0 at masked positions), returns `[B, T]`.
    """
    _check_unit_interval(gamma=gamma)
    mask = response_mask.bool()
    breaks = torch.zeros_like(mask)
    breaks[:, :-1] = ~mask[:, 1:]
    returns = discounted_reverse_cumsum(token_level_rewards.to(_F64), float(gamma), breaks=breaks)
    advantages = masked_whiten(returns, mask) * mask
    dtype = token_level_rewards.dtype
    return advantages.to(dtype), returns.to(dtype)


@ADV_ESTIMATORS.register("remax")
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (arXiv:2310.10505): return-to-go minus the reward of the greedy response.

    Args:
        token_level_rewards, response_mask: `[B, T]`.
        reward_baselines: `[B]` reward of each prompt's greedy (argmax) response.

    Returns:
        advantages = returns - baseline * mask, returns = reverse cumsum of masked rewards; `[B, T]`.
    """
    mask = response_mask.to(token_level_rewards.dtype)
    returns = reverse_cumsum(token_level_rewards * mask)
    advantages = returns - reward_baselines.to(returns.dtype).unsqueeze(-1) * mask
    return advantages, returns
