"""A tool class written against verl's BaseTool runs after changing its imports only.

``VERL_USER_TOOL`` is how a verl user writes a stateful tool (the shape of verl's own
``gsm8k_tool.py``: instance dict, ``create_kwargs`` fallback, ``@rollout_trace_op``, the
``(ToolResponse, reward, metrics)`` return). The test rewrites only its ``from verl...`` lines
and loads it through a verl tool config file, then through the hermes parser and the runner.
"""

from __future__ import annotations

import sys

from megarl.tools.parser import parse_tool_calls
from megarl.tools.registry import load_tool_config
from megarl.tools.runner import ToolCallError, run_tool_calls
from tests.tools.conftest import run

VERL_USER_TOOL = """
import logging
from typing import Any, Optional
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.rollout_trace import rollout_trace_op

logger = logging.getLogger(__name__)


class WordCountTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}
        self.bonus = config.get("bonus", 0.5)

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        if instance_id is None:
            instance_id = str(uuid4())
        target = kwargs.get("create_kwargs", {}).get("target", 0)
        self._instance_dict[instance_id] = {"target": target, "reward": 0.0}
        return instance_id, ToolResponse()

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        words = len(parameters.get("text", "").split())
        hit = words == self._instance_dict[instance_id]["target"]
        self._instance_dict[instance_id]["reward"] = 1.0 if hit else 0.0
        return ToolResponse(text=f"{words} words"), (self.bonus if hit else 0.0), {"words": words}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return self._instance_dict[instance_id]["reward"]

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
"""

TOOL_CONFIG = """
tools:
  - class_name: "user_tools_mod.WordCountTool"
    config:
      type: native
      bonus: 0.25
    tool_schema:
      type: "function"
      function:
        name: "count_words"
        description: "Counts the words of a text"
        parameters:
          type: "object"
          properties:
            text:
              type: "string"
              description: "The text"
          required: ["text"]
"""


def change_imports(source: str) -> str:
    return source.replace("from verl.tools.", "from megarl.tools.").replace(
        "from verl.utils.rollout_trace", "from megarl.tools.rollout_trace"
    )


def test_a_verl_tool_runs_after_changing_its_imports(tmp_path, write, monkeypatch):
    changed = change_imports(VERL_USER_TOOL)
    assert changed.count("megarl") == 3 and "verl." not in changed.replace("megarl.", "")
    write("user_tools_mod.py", changed)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_tools_mod", raising=False)
    (tool,) = load_tool_config(write("tools.yaml", TOOL_CONFIG))
    assert tool.name == "count_words" and tool.bonus == 0.25
    schema = tool.get_openai_tool_schema().model_dump(exclude_unset=True, exclude_none=True)
    assert schema["function"]["parameters"]["required"] == ["text"]

    turn = parse_tool_calls(
        'Let me count.\n<tool_call>\n{"name": "count_words", "arguments": {"text": "a b c"}}\n'
        "</tool_call>"
    )
    tools_kwargs = {"count_words": {"create_kwargs": {"target": 3}}}
    (result,) = run(run_tool_calls(turn.calls, {tool.name: tool}, tools_kwargs=tools_kwargs))
    assert result.error is ToolCallError.NONE
    assert (result.text, result.reward, result.metrics) == ("3 words", 0.25, {"words": 3})
    assert tool._instance_dict == {}  # created, executed and released per call, as verl
