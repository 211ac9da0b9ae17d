"""``BaseTool``: verl 0.9.1's stateful tool interface (``verl/tools/base_tool.py``), same methods,
arguments and returns, so a verl tool class runs after changing its imports only.

A tool is built once per process as ``cls(config=<dict>, tool_schema=<OpenAIFunctionToolSchema
or None>)``. For each call the rollout creates an instance, executes, and releases it (verl
0.9.1's agent loop; :func:`megarl.tools.runner.run_tool_calls`):

- ``create(instance_id=None, **kwargs) -> (instance_id, ToolResponse)``; the rollout passes the
  sample's ``extra_info.tools_kwargs[<tool name>]["create_kwargs"]`` as ``create_kwargs=``;
- ``execute(instance_id, parameters, **kwargs) -> (ToolResponse, reward, metrics)``; the reward
  may be None (then no step reward is recorded, as in verl);
- ``calc_reward(instance_id, **kwargs) -> float``; ``release(instance_id, **kwargs) -> None``.

Difference from verl: the constructor logs the schema at DEBUG level; verl prints it.
"""

from __future__ import annotations

import json
import logging
from typing import Any
from uuid import uuid4

from megarl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["BaseTool"]

logger = logging.getLogger(__name__)


class BaseTool:
    """A tool the model can call (see the module docstring)."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        self.config = config
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(f"{type(self).__name__}: no tool_schema given and no default schema")
        self.name = self.tool_schema.function.name
        if logger.isEnabledFor(logging.DEBUG):
            dumped = self.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
            logger.debug("tool %s: %s", self.name, json.dumps(dumped))

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        """The schema shown to the model (a subclass may return a default when none is given)."""
        return getattr(self, "tool_schema", None)

    async def create(
        self, instance_id: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        """A new instance: its id (``instance_id`` or a fresh UUID) and a creation response."""
        return (str(uuid4()) if instance_id is None else instance_id), ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float | None, dict]:
        """Run the call: (response, step reward, metrics)."""
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The instance's reward (verl's agent loop never calls it; trajectory-scoped runs do)."""
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Forget the instance."""
