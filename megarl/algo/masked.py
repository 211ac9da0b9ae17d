"""Masked reductions over `[B, T]` tensors.

A mask is boolean or 0/1 (binary: verl also multiplies by the mask, which only matters for
fractional weights, unused here) of the same shape as the values. Positions where the mask is zero
never reach a result, not even as NaN or inf: they are replaced by zero before any arithmetic.
"""

from __future__ import annotations

import torch

_EPS = 1e-8


def masked_sum(
    values: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Sum of `values` where the (binary) `mask` is non-zero, over `dim` (all if None)."""
    kept = torch.where(mask.bool(), values, 0.0)
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Mean of `values` over the masked elements (binary mask); an empty mask gives 0.

    verl divides by count + 1e-8; megarl divides by max(count, 1), which is exact for binary masks.
    """
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.to(values.dtype).clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all masked elements (a scalar), Bessel-corrected when `unbiased`.

    verl raises when fewer than two elements are selected; megarl returns 0 instead (deliberate:
    a batch with a single valid token must not stop training or produce NaN).
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum().to(values.dtype)
        var = torch.where(count > 1, var * count / (count - 1).clamp(min=1), torch.zeros_like(var))
    return var


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = _EPS
) -> torch.Tensor:
    """`(values - mean) / sqrt(var + eps)` with mean and unbiased variance over the mask.

    Every position is transformed (masked ones too, as in verl); if `shift_mean` is False the mean is
    added back after scaling. Shapes: any, `mask` broadcastable to `values`.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
