"""The multi-turn loop's records (:mod:`megarl.rollout.multi_turn`): its settings
(:class:`MultiTurnSettings`), a prompt (:class:`TrajectoryPrompt`) and a trajectory
(:class:`Trajectory`). A module of their own so that the loop's helpers
(:mod:`~megarl.rollout.multi_turn_agent`, :mod:`~megarl.rollout.multi_turn_output`) import them
without importing the loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megarl.tools.runner import ToolCallResult

__all__ = ["MultiTurnSettings", "Trajectory", "TrajectoryPrompt"]


@dataclass
class MultiTurnSettings:
    """What the loop needs of ``actor_rollout_ref.rollout.multi_turn`` and the data section."""

    response_length: int
    """``data.max_response_length``: tokens of all turns together (model, tool and user)."""
    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    format: str = "hermes"
    tokenization_sanity_check_mode: str = "strict"
    tool_call_timeout_s: float | None = 60.0
    max_model_len: int | None = None
    """The engine's context limit: one turn's max_tokens never asks past it."""
    prompt_length: int | None = None
    """``rollout.prompt_length`` (default ``data.max_prompt_length``): a rendered prompt longer
    than this keeps its last ``prompt_length`` ids (verl 0.9.1's agent loop cuts it from the
    left, the tools' schemas included); None: not cut."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, multi_turn: Any, *, response_length: int, **extra: Any):
        """From a :class:`~megarl.config.schema_rollout.MultiTurnConfig`."""
        names = (
            "max_assistant_turns", "max_user_turns", "max_parallel_calls",
            "max_tool_response_length", "tool_response_truncate_side", "format",
            "tokenization_sanity_check_mode", "tool_call_timeout_s",
        )  # fmt: skip
        return cls(
            response_length=response_length,
            **{n: getattr(multi_turn, n) for n in names},
            **extra,
        )


@dataclass
class TrajectoryPrompt:
    """One prompt of the step: its chat messages and the dataset's per-sample arguments."""

    messages: list[dict[str, Any]]
    prompt_id: int
    """Global id of the prompt (GRPO's group)."""
    tools_kwargs: dict[str, Any] = field(default_factory=dict)
    """``extra_info.tools_kwargs``: per tool name, ``create_kwargs`` (and others)."""
    interaction_kwargs: dict[str, Any] | None = None
    """``extra_info.interaction_kwargs`` (its ``name`` picks the interaction)."""
    prompt_ids: list[int] | None = None
    """Token ids to start from; None: the messages rendered with the tools' schemas."""


@dataclass
class Trajectory:
    """One multi-turn response: every turn's ids back to back."""

    prompt_index: int
    sample_index: int
    prompt_id: int
    prompt_ids: list[int]
    """The prompt's ids as the model sees them (cut to ``prompt_length`` from the left)."""
    response_ids: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    """vLLM's log-probs on model tokens, 0.0 on tool and user tokens."""
    response_mask: list[int] = field(default_factory=list)
    """1 on the model's tokens, 0 on tool and user tokens."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation: the prompt's messages, then each turn's."""
    assistant_turns: int = 0
    user_turns: int = 0
    """Tool turns and interaction turns."""
    tool_results: list[ToolCallResult] = field(default_factory=list)
    tool_rewards: list[float] = field(default_factory=list)
    """Step rewards ``execute`` returned (not None; 0.0 for a failed call), in call order."""
    turn_scores: list[float] = field(default_factory=list)
    """Interaction scores, one per interaction turn."""
    finish_reason: str = "stop"
    """``stop``: the last model turn ended on a stop token; ``length``: it was cut."""
    tokenization_ok: bool | None = None
    """The sanity check's verdict (None: disabled)."""
    drifted_turns: int = 0
    """Tool/user turns whose delta came from renderings alone (ids held ≠ re-rendering)."""
    done: bool = False
    cut_prompt_ids: list[int] = field(default_factory=list)
    """The ids cut off the prompt's start (``prompt_length``); the template's renderings are
    compared with these + ``prompt_ids`` + ``response_ids``."""
    prompt_messages: int = 0
    """How many of ``messages`` are the prompt's."""
    last_turn_len: int = 0
    """Tokens of the last model turn."""
    assistant_texts: list[str] = field(default_factory=list)
    """Each model turn's text decoded without special tokens (verl's assistant message, what
    interactions and tools' ``agent_data`` see); ``messages`` keeps them for the template."""
    routing: Any = None
    """With routing capture on (R3): the experts of each position of prompt + response, each
    from the first request that ran it through the model (a model token's from its own turn, a
    tool or user token's from the next turn's prefill); ``[positions, layers, k]``; else None."""

    @property
    def num_turns(self) -> int:
        """verl's ``num_turns``: user + assistant turns + 1 (the prompt)."""
        return self.assistant_turns + self.user_turns + 1
