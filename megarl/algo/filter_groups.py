"""DAPO's dynamic sampling, the pure part: which groups a generation batch keeps.

verl (verl-recipe's DAPO trainer) keeps a group when the filter metric of its responses has a
non-zero standard deviation, or when it holds one response; the rest are dropped and generation
goes on until ``data.train_batch_size`` groups are kept. megarl tests "not all equal" (max >
min), the same thing without float rounding (np.std of identical non-representable values can
be a few ulps above 0).
"""

from __future__ import annotations

import torch


def kept_group_rows(metric: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: the responses whose group (``index`` ``[B]``) is kept, given each
    response's filter ``metric`` ``[B]``: groups of one, and groups whose metric varies."""
    ids, group = torch.unique(index, return_inverse=True)
    n = len(ids)
    values = metric.to(torch.float64)
    high = torch.full((n,), -torch.inf, dtype=torch.float64).scatter_reduce(
        0, group, values, "amax"
    )
    low = torch.full((n,), torch.inf, dtype=torch.float64).scatter_reduce(0, group, values, "amin")
    count = torch.zeros(n, dtype=torch.long).scatter_add(0, group, torch.ones_like(group))
    keep = (high > low) | (count == 1)
    return keep[group]
