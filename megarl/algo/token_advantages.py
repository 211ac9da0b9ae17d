"""Token-level advantage estimators REINFORCE++ and ReMax (GAE has its own module, gae.py).

Every estimator takes `[B, T]` tensors over the response tokens and returns `(advantages, returns)`,
both `[B, T]` in the dtype of the inputs. Masks are binary (bool or 0/1). All of them run under
`torch.no_grad()`; nothing here loops over time steps (see `scan.py`).
"""

from __future__ import annotations

import torch

from megarl.algo.masked import masked_whiten
from megarl.algo.registry import ADV_ESTIMATORS
from megarl.algo.scan import discounted_reverse_cumsum, exclusive_cumsum, reverse_cumsum

_F64 = torch.float64


def _check_unit_interval(**params: float) -> None:
    for name, value in params.items():
        if not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"{name} must lie in [0, 1], got {value}")


@ADV_ESTIMATORS.register(
    "reinforce_plus_plus", inputs=("token_level_rewards", "response_mask", "gamma")
)
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (arXiv:2501.03262): discounted returns, whitened over the batch.

    verl 0.9.1's recurrence, going backwards with a running return R = 0:
        valid t:   R = r[t] + gamma * R;  returns[t] = R
        masked t:  R carried through unchanged (no discount, r[t] ignored);  returns[t] = 0
    so at a valid t, returns[t] = sum over valid s >= t of gamma**(valid steps in [t, s)) * r[s]:
    a masked span (tool output, another turn) passes the later reward on to the tokens before it.
    (verl before 0.9.1, and megarl before, reset R at every masked step instead, cutting the
    credit of every token before the span.) Right-padded rows are unaffected by the change.
    advantages = masked_whiten(returns, mask) * mask.

    Args:
        token_level_rewards, response_mask: `[B, T]`.
        gamma: discount (`algorithm.gamma`), in [0, 1].

    Returns:
        advantages `[B, T]`, returns `[B, T]`; both 0 at masked positions.
    """
    _check_unit_interval(gamma=gamma)
    mask = response_mask.bool()
    masked_rewards = torch.where(mask, token_level_rewards.to(_F64), 0.0)
    # exponents = valid steps before t: a valid step decays by gamma, a masked one carries.
    returns = discounted_reverse_cumsum(masked_rewards, float(gamma), exclusive_cumsum(mask))
    returns = returns * mask
    advantages = masked_whiten(returns, mask) * mask
    dtype = token_level_rewards.dtype
    return advantages.to(dtype), returns.to(dtype)


@ADV_ESTIMATORS.register(
    "remax", inputs=("token_level_rewards", "reward_baselines", "response_mask")
)
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
