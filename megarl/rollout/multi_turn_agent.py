"""What the multi-turn loop's tools and interactions see of a trajectory
(:mod:`megarl.rollout.multi_turn`): :class:`AgentData`, verl's ``agent_data`` argument of every
tool's ``execute``, and the conversation with each model turn decoded without special tokens
(verl's assistant messages)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megarl.rollout.multi_turn_types import Trajectory, TrajectoryPrompt

__all__ = ["AgentData", "agent_data", "visible_messages"]


@dataclass
class AgentData:
    """What every tool's ``execute`` gets as ``agent_data=`` (verl's ``AgentData``, the fields
    a tool may read): one per trajectory, made at its first tool turn on the rank that runs
    the tools and refreshed from the trajectory before each tool turn; ``extra_fields`` (a
    tool's own per-trajectory state) is kept across the turns. Not broadcast to other ranks."""

    request_id: str
    """A hex id of the trajectory (verl: the request's)."""
    tools_kwargs: dict[str, Any]
    interaction_kwargs: dict[str, Any]
    interaction: Any = None
    """The trajectory's interaction, None without one."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation so far (a copy), model turns as :attr:`Trajectory.assistant_texts`."""
    prompt_ids: list[int] = field(default_factory=list)
    """Prompt and every turn so far (verl's ``prompt_ids`` grows so)."""
    response_ids: list[int] = field(default_factory=list)
    """The last model turn's ids (verl's)."""
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    turn_scores: list[float] = field(default_factory=list)
    tool_rewards: list[float] = field(default_factory=list)
    user_turns: int = 0
    assistant_turns: int = 0
    tool_calls: list[Any] = field(default_factory=list)
    """This turn's parsed calls (``name``, ``arguments``: verl's ``FunctionCall`` fields)."""
    extra_fields: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    image_data: Any = None
    video_data: Any = None


def visible_messages(traj: Trajectory) -> list[dict[str, Any]]:
    """The conversation as verl's loop holds it: each model turn decoded without special
    tokens (the interactions' and tools' view; the template renders ``traj.messages``)."""
    out = [dict(m) for m in traj.messages]
    texts = iter(traj.assistant_texts)
    for m in out[traj.prompt_messages :]:
        if m["role"] == "assistant":
            m["content"] = next(texts, m["content"])
    return out


def agent_data(
    agents: dict[tuple[int, int], AgentData],
    traj: Trajectory,
    prompt: TrajectoryPrompt,
    session: Any,
    calls: list[Any],
) -> AgentData:
    """``traj``'s :class:`AgentData` in ``agents`` (made at its first call), refreshed for the
    tool turn of ``calls`` (``session``: its interaction's ``(interaction, id, kwargs)``)."""
    key = (traj.prompt_index, traj.sample_index)
    if key not in agents:
        agents[key] = AgentData(
            uuid.uuid4().hex,
            dict(prompt.tools_kwargs),
            dict(prompt.interaction_kwargs or {}),
            session[0] if session else None,
        )  # fmt: skip
    agent = agents[key]
    agent.messages = visible_messages(traj)
    agent.prompt_ids = traj.prompt_ids + traj.response_ids
    agent.response_ids = traj.response_ids[len(traj.response_ids) - traj.last_turn_len :]
    agent.response_mask = list(traj.response_mask)
    agent.response_logprobs = list(traj.response_logprobs)
    agent.turn_scores, agent.tool_rewards = list(traj.turn_scores), list(traj.tool_rewards)
    agent.user_turns, agent.assistant_turns = traj.user_turns, traj.assistant_turns
    agent.tool_calls = list(calls)
    return agent
