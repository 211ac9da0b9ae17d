"""``Gsm8kTool``: the model submits its answer and hears whether it is right (verl's
``verl.tools.gsm8k_tool.Gsm8kTool``, which verl 0.9.1 no longer ships; written from the
behaviour of its last version, verl 0.8).

``create(ground_truth=...)`` or ``create(create_kwargs={"ground_truth": ...})`` (the sample's
``extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs``) stores the reference answer.
``execute({"answer": ...})`` prefixes the answer with ``"#### "`` unless it has it, scores it
with megarl's GSM8K scorer (flexible: the last number; 1.0 right, 0.0 otherwise), and answers
``Current parsed answer='72' reward=1.0``; the step reward is 0.0 when the score improved on the
instance's previous one, else -0.05 (with verl 0.9.1's instance per call: 0.0 for a right
answer, -0.05 for a wrong one). ``calc_reward`` is the current score.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from megarl.reward.scorers import gsm8k
from megarl.tools.base_tool import BaseTool
from megarl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["DEFAULT_SCHEMA", "Gsm8kTool"]

DEFAULT_SCHEMA = OpenAIFunctionToolSchema.model_validate(
    {
        "type": "function",
        "function": {
            "name": "calc_gsm8k_reward",
            "description": "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is "
            "correct, 0.0 if parsed answer is incorrect or not correctly parsed)",
            "parameters": {
                "type": "object",
                "properties": {
                    "answer": {
                        "type": "string",
                        "description": "The model's answer to the GSM8K math problem, must be "
                        "a digits",
                    }
                },
                "required": ["answer"],
            },
        },
    }
)
"""verl's example schema (``gsm8k_tool_config.yaml``), used when the config gives none."""

NO_IMPROVEMENT_PENALTY = -0.05


class Gsm8kTool(BaseTool):
    """Checks a submitted GSM8K answer against the instance's ground truth."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict[str, Any]] = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return getattr(self, "tool_schema", None) or DEFAULT_SCHEMA

    async def create(
        self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        instance_id = str(uuid4()) if instance_id is None else instance_id
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        answer = parameters.get("answer", "")
        if not isinstance(answer, str):
            answer = str(answer)
        state = self._instances[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else NO_IMPROVEMENT_PENALTY
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        state = self._instances[instance_id]
        if state["ground_truth"] is None:
            return 0.0
        return gsm8k.compute_score(
            state["response"], str(state["ground_truth"]), method="flexible", format_score=0.0,
            score=1.0,
        )  # fmt: skip

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)
