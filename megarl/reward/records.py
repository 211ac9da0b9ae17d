"""What a reward manager scores and what it gives back: :class:`RewardInput` (one response),
:class:`RewardResult` (a batch's scores) and :func:`reward_inputs`, which builds the inputs of a
rollout batch. Kept apart from :mod:`megarl.reward.manager` so that :mod:`megarl.reward.dump`
reads the types without importing the manager (no import circle)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ADDS_ROLLOUT_FIELDS", "RewardInput", "RewardResult", "reward_inputs"]


@dataclass
class RewardInput:
    """One response to score, as the trainer has it after generation."""

    data_source: str
    """The prompt's ``data_source`` (or the ``data.reward_fn_key`` column)."""
    response_ids: Sequence[int]
    """Valid response token ids only (EOS included when generated; no padding)."""
    ground_truth: Any
    """``reward_model.ground_truth`` of the prompt."""
    extra_info: dict[str, Any] | None = None
    """The prompt's ``extra_info``; for a multi-turn response (``rollout``), with what verl's
    naive manager adds to it (:func:`reward_inputs`)."""
    prompt: str = ""
    """Prompt text, for the dump only."""
    prompt_ids: Sequence[int] = ()
    """Prompt token ids (a user's reward manager class reads them, as verl's ``prompts``)."""
    rollout: dict[str, Any] | None = None
    """A multi-turn response's record (``num_turns``, ``tool_rewards``, ``turn_scores``);
    None for a single-turn one."""
    prompt_extra_info: dict[str, Any] | None = None
    """With ``rollout``: the prompt's own ``extra_info``, which the managers other than naive
    pass on unchanged (verl 0.9.1's reward loop)."""

    def scorer_extra_info(self, manager: str) -> dict[str, Any] | None:
        """The ``extra_info`` the reward function gets under reward manager ``manager``: verl
        0.9.1's naive manager adds the agent loop's fields (:func:`reward_inputs`); its dapo
        and gdpo managers, the legacy prime one and a user's class do not."""
        if self.rollout is None or manager in ADDS_ROLLOUT_FIELDS:
            return self.extra_info
        return self.prompt_extra_info


ADDS_ROLLOUT_FIELDS = ("naive",)
"""The reward managers that put a multi-turn response's record into ``extra_info`` (verl 0.9.1:
naive and remote; megarl has no remote)."""


@dataclass
class RewardResult:
    """Scores of a global batch of ``B`` responses."""

    token_level_rewards: torch.Tensor
    """``[B, T]`` float32: the score on each response's last valid token, 0 elsewhere."""
    scores: torch.Tensor
    """``[B]`` float32 per-sample scores (0 for a timed-out sample)."""
    fields: dict[str, torch.Tensor]
    """Numeric (and bool) dict fields of the scorer: name -> ``[B]`` float32."""
    extra: dict[str, list[Any]]
    """Non-numeric dict fields (e.g. math_dapo's ``pred``): name -> ``B`` values (None if absent)."""
    timed_out: torch.Tensor
    """``[B]`` bool: the sample exceeded the time limit."""
    metrics: dict[str, float] = field(default_factory=dict)
    """``reward/<data_source>/mean|min|max|count``, ``reward/<data_source>/<field>/mean``,
    ``reward/timeouts``."""
    function_scores: torch.Tensor | None = None
    """``[B]`` float32: the reward function's own scores, before the dapo manager's overlong
    penalty (verl's ``reward_extra_info["score"]``); None: the same as ``scores``."""

    def __post_init__(self) -> None:
        if self.function_scores is None:
            self.function_scores = self.scores


def reward_inputs(
    tokenizer: Any, prompts: Sequence[Any], samples: Sequence[Any]
) -> list[RewardInput]:
    """The samples of a rollout batch to score: each sample's prompt (``prompts[prompt_index]``,
    anything with ``data_source``, ``ground_truth`` and ``extra_info``) with its response."""
    out = []
    for s in samples:
        own, rollout = prompts[s.prompt_index].extra_info, getattr(s, "extra", None)
        out.append(
            RewardInput(
                data_source=prompts[s.prompt_index].data_source,
                response_ids=s.response_token_ids,
                ground_truth=prompts[s.prompt_index].ground_truth,
                extra_info=_extra_info(own, rollout),
                prompt=tokenizer.decode(s.prompt_token_ids, skip_special_tokens=False),
                prompt_ids=s.prompt_token_ids,
                rollout=rollout,
                prompt_extra_info=own if rollout is not None else None,
            )
        )
    return out


def _extra_info(extra_info: dict | None, rollout: dict | None) -> dict | None:
    """The naive manager's ``extra_info``: the prompt's, and for a multi-turn response
    (``rollout``: its sample's ``extra``) what verl 0.9.1's naive manager adds to it: the agent
    loop's ``tool_rewards`` and ``turn_scores`` (interaction scores), ``num_turns``, and
    ``rollout_reward_scores`` (``{}``: verl's tool agent loop sets none)."""
    if rollout is None:
        return extra_info
    return {
        **(extra_info or {}),
        "turn_scores": list(rollout.get("turn_scores", [])),
        "tool_rewards": list(rollout.get("tool_rewards", [])),
        "num_turns": rollout.get("num_turns"),
        "rollout_reward_scores": {},
    }
