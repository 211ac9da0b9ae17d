"""DAPO's overlong reward shaping (verl's ``dapo`` reward manager): a response longer than
``max_resp_len - buffer_len`` tokens loses ``penalty_factor`` per ``buffer_len`` tokens beyond
that, linearly, and nothing below it.

    expected = max_resp_len - buffer_len
    penalty  = min(-(length - expected) / buffer_len * penalty_factor, 0)

The penalty is added to the scorer's score (the reward a response gets, and the score its
metrics and the filter's ``seq_reward`` see); the scorer's own score stays in the ``acc`` field.
Pure: no torch.distributed, no config.
"""

from __future__ import annotations

import torch


def overlong_penalty(
    lengths: torch.Tensor, *, max_resp_len: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """``[B]`` float32 penalties (<= 0) of responses of ``lengths`` ``[B]`` valid tokens."""
    expected = max_resp_len - buffer_len
    exceed = lengths.to(torch.float32) - expected
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)
