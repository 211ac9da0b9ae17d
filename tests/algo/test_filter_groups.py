"""DAPO's group filter on hand-made groups: zero-variance groups dropped, groups of one kept."""

from __future__ import annotations

import torch

from megarl.algo.filter_groups import kept_group_rows


def test_zero_variance_groups_are_dropped_and_groups_of_one_kept():
    # groups: 0 all correct, 1 mixed, 2 all wrong, 3 one response, 4 mixed scores
    index = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 4, 4])
    acc = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 0, 0, 1, 0.5, -0.25])
    kept = kept_group_rows(acc, index)
    assert kept.tolist() == [False] * 3 + [True] * 3 + [False] * 3 + [True] + [True] * 2


def test_ids_need_not_be_contiguous():
    index = torch.tensor([7, 3, 7, 3])
    assert kept_group_rows(torch.tensor([1.0, 2, 1, 2]), index).tolist() == [False] * 4
    assert kept_group_rows(torch.tensor([1.0, 2, 0, 2]), index).tolist() == [True, False] * 2
