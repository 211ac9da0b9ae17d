"""``Gsm8kInteraction``: a user who says whether the last answer is right (verl's
``verl.interactions.gsm8k_interaction.Gsm8kInteraction``, written from its behaviour).

``start_interaction(instance_id, ground_truth=...)`` stores the reference answer.
``generate_response`` scores the content of the last assistant message with megarl's GSM8K
scorer (strict: ``#### <number>``): 1.0 answers ``Your response is correct!`` and ends the
trajectory; otherwise ``Your response is incorrect! You need to reflect on your answer and try
again.`` and the trajectory goes on. The turn score is that 1.0 or 0.0.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from megarl.reward.scorers import gsm8k
from megarl.tools.interactions.base import BaseInteraction

__all__ = ["CORRECT", "INCORRECT", "Gsm8kInteraction"]

CORRECT = "Your response is correct!"
INCORRECT = "Your response is incorrect! You need to reflect on your answer and try again."


class Gsm8kInteraction(BaseInteraction):
    """Feedback on a GSM8K answer (see the module docstring)."""

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        self._instances: dict[str, dict[str, Any]] = {}

    async def start_interaction(
        self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs: Any
    ) -> str:
        instance_id = str(uuid4()) if instance_id is None else instance_id
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        content = next(
            (m.get("content") for m in reversed(messages) if m.get("role") == "assistant"), ""
        )
        self._instances[instance_id]["response"] = content if isinstance(content, str) else ""
        reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            return True, CORRECT, reward, {}
        return False, INCORRECT, reward, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs: Any) -> float:
        state = self._instances[instance_id]
        if state["ground_truth"] is None:
            return 0.0
        return gsm8k.compute_score(
            state["response"], str(state["ground_truth"]), method="strict", format_score=0.0,
            score=1.0,
        )  # fmt: skip

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)
