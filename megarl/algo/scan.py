"""Vectorized reverse linear recurrences (the engine behind GAE and discounted returns).

`discounted_reverse_cumsum` solves y[t] = x[t] + a[t] * y[t + 1] (y[T] = 0) for every row of a
`[B, T]` tensor, each a[t] being `decay`, 1 (carry through) or 0 (a break), with no Python loop
over time steps: one weighting, one reverse cumulative sum and one un-weighting. Used by
REINFORCE++ (breaks) and by GAE's direct route (masked steps carry).
"""

from __future__ import annotations

import math

import torch

# Largest |log weight| inside one block: exp(-600) ~ 1e-261 keeps float64 far from underflow.
_MAX_LOG_RANGE = 600.0


def reverse_cumsum(x: torch.Tensor) -> torch.Tensor:
    """`y[..., t] = sum_{s >= t} x[..., s]` along the last dim, accumulated from the end."""
    return x.flip(-1).cumsum(-1).flip(-1)


def exclusive_cumsum(mask: torch.Tensor) -> torch.Tensor:
    """int64 `[B, T]`: number of non-zero entries of `mask` strictly before each position."""
    inclusive = torch.cumsum(mask, dim=-1, dtype=torch.int64)
    exclusive = torch.zeros_like(inclusive)
    exclusive[..., 1:] = inclusive[..., :-1]
    return exclusive


def _block_length(decay: float) -> int:
    """Longest run of decaying steps whose weights decay**k stay within exp(-_MAX_LOG_RANGE)."""
    if decay == 1.0:
        return 1 << 62
    return max(1, int(_MAX_LOG_RANGE / -math.log(decay)))


def _powers(n: int, decay: float, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[n]` decay**k and decay**-k for k = 0..n-1 (n within one block)."""
    k = torch.arange(n, dtype=like.dtype, device=like.device)
    powers = torch.exp(k * math.log(decay))
    return powers, 1.0 / powers


def discounted_reverse_cumsum(
    x: torch.Tensor,
    decay: float,
    exponents: torch.Tensor | None = None,
    breaks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Solve `y[t] = x[t] + a[t] * y[t+1]` (y[T] = 0) for all rows at once.

    With E[t] the number of decaying steps before t,
    y[t] = decay**(-E[t]) * sum_{s >= t, no break in [t, s)} decay**E[s] * x[s]. The sum is
    accumulated from the end, so its rounding error stays relative to the size of y[t] (float64:
    ~1e-16 * T). The time axis is cut into blocks whose weights stay within
    exp(+-_MAX_LOG_RANGE), joined by carrying y at each block start into the block before it (one
    block for decay >= 0.87 at T = 4096). A break's segment sum is the reverse cumsum minus the
    reverse cumsum at the segment's end.

    Args:
        x: `[B, T]` floating tensor (use float64 for accuracy; the result has x's dtype).
        decay: the decay factor g, 0 <= g <= 1.
        exponents: int64 `[B, T]`, non-decreasing by 0 or 1 per step: a step t decays (a[t] = g)
            when `exponents[t+1] - exponents[t] == 1` and carries (a[t] = 1) when it is 0; use
            `exclusive_cumsum(step_mask)`. None means every step decays (`exponents[t] = t`).
        breaks: bool `[B, T]` or None; a[t] = 0 where True (y[t] = x[t], nothing flows past t).

    Returns:
        y: `[B, T]`, same dtype as x.
    """
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must lie in [0, 1], got {decay}")
    if x.dim() != 2:
        raise ValueError(f"x must be [B, T], got shape {tuple(x.shape)}")
    T = x.shape[1]
    if T == 0:
        return x.clone()
    if decay == 0.0 and exponents is None:
        return x.clone()  # every step multiplies by 0 (breaks only cut earlier)
    if decay == 0.0:
        # A decaying step multiplies by 0: it is a break. The remaining steps carry with factor 1.
        steps = torch.zeros_like(exponents, dtype=torch.bool)
        steps[:, :-1] = exponents[:, 1:] != exponents[:, :-1]
        steps[:, -1] = True  # y[T] = 0 anyway
        breaks = steps if breaks is None else (breaks.bool() | steps)
        exponents = torch.zeros_like(exponents)
        decay = 1.0
    block = _block_length(decay)
    if block >= T:
        return _scan_block(x, decay, exponents, breaks, carry=None, carry_exponent=None)

    out = torch.empty_like(x)
    carry = None
    carry_exponent = None
    for start in reversed(range(0, T, block)):  # a loop over blocks, not over time steps
        end = min(start + block, T)
        out[:, start:end] = _scan_block(
            x[:, start:end],
            decay,
            None if exponents is None else exponents[:, start:end],
            None if breaks is None else breaks[:, start:end],
            carry=carry,
            carry_exponent=carry_exponent,
        )
        carry = out[:, start]
        carry_exponent = None if exponents is None else exponents[:, start]
    return out


def _scan_block(
    x: torch.Tensor,
    decay: float,
    exponents: torch.Tensor | None,
    breaks: torch.Tensor | None,
    carry: torch.Tensor | None,
    carry_exponent: torch.Tensor | None,
) -> torch.Tensor:
    """One block of the recurrence; `carry` is y just after the block (exponent `carry_exponent`).

    `exponents` None means every step decays: the weights are then one `[n]` row broadcast over B.
    """
    B, L = x.shape
    if carry is not None:
        # The carry behaves like one more element x[L] = y[L] with no break at L.
        x = torch.cat([x, carry[:, None]], dim=1)
        if exponents is not None:
            exponents = torch.cat([exponents, carry_exponent[:, None]], dim=1)
        if breaks is not None:
            breaks = torch.cat([breaks.bool(), breaks.new_zeros(B, 1, dtype=torch.bool)], dim=1)
    n = x.shape[1]
    powers = inverse = None
    if decay != 1.0:
        powers, inverse = _powers(n, decay, x)  # decay**k >= exp(-_MAX_LOG_RANGE)
        if exponents is not None:
            local = exponents - exponents[:, :1]  # 0 .. block length: inside the safe range
            powers = powers.expand(B, n).gather(1, local)
            inverse = inverse.expand(B, n).gather(1, local)
    # Reverse cumsum of the weighted x, working in place on one flipped copy (fewer allocations
    # of [B, T] float64 buffers: this function dominates GAE's run time).
    sums = x.flip(-1)
    if powers is not None:
        sums.mul_(powers.flip(-1))
    sums = sums.cumsum_(-1).flip(-1)
    if breaks is not None:
        b = breaks.bool()
        seg_after = torch.cumsum(b, dim=-1, dtype=torch.int64)  # segment index just after each t
        seg = seg_after - b.to(torch.int64)  # segment index of t
        # tail[j] = reverse cumsum at the first position of segment j (0 past the last segment):
        # for a break at t, segment seg_after[t] starts at t + 1.
        after = torch.zeros_like(sums)
        after[:, :-1] = sums[:, 1:]
        tail = torch.zeros(B, n + 2, dtype=x.dtype, device=x.device)
        tail.scatter_add_(1, seg_after, after.masked_fill_(~b, 0.0))
        sums = sums.sub_(tail.gather(1, seg + 1))
    if inverse is not None:
        sums = sums.mul_(inverse)
    return sums[:, :L] if carry is not None else sums
