"""``BaseInteraction``: verl's interaction interface (``verl/interactions/base.py``), same async
methods and returns, so a verl interaction class runs after changing its import only.

Built once per process as ``cls(config=<dict>)`` (``config["name"]`` set by the registry). Per
trajectory the rollout calls ``start_interaction(instance_id, **interaction_kwargs)`` (the
sample's ``extra_info.interaction_kwargs``, ``name`` included, as verl), then after each model
turn without a tool call ``generate_response(instance_id, messages, **interaction_kwargs)`` →
``(should_terminate_sequence, response_content, current_turn_score, additional_data)``; the
response becomes a user turn and the score joins the trajectory's ``turn_scores``.

Difference: verl's base ``calculate_score(self)`` and ``finalize_interaction(self)`` take no
arguments while its subclasses take ``instance_id``; here the base accepts ``instance_id`` and
keywords too, so a rollout can call every interaction the same way.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

__all__ = ["BaseInteraction"]


class BaseInteraction:
    """A scripted conversation partner (see the module docstring)."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Start an instance; its id (``instance_id`` or a fresh UUID)."""
        return str(uuid4()) if instance_id is None else instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """(should_terminate_sequence, response_content, current_turn_score, additional_data)."""
        return False, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs: Any) -> float:
        """The interaction's score."""
        return 0.0

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs: Any) -> None:
        """Release the instance's state."""
