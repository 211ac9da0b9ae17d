"""Tools and interactions for multi-turn rollouts, in verl 0.9.1's vocabulary (no trainer or
rollout engine here: the multi-turn rollout loop builds on these).

- :mod:`.base_tool`: ``BaseTool`` (verl's async ``create`` / ``execute`` / ``calc_reward`` /
  ``release``); :mod:`.schemas`: ``OpenAIFunctionToolSchema``, ``ToolResponse`` (verl's models).
- :mod:`.function_tool`: ``@function_tool`` and ``function_tool_path`` files.
- :mod:`.registry`: ``load_tool_config``, ``load_all_tools`` (verl's tool config YAML).
- :mod:`.parser`: ``parse_tool_calls`` (``hermes``), ``ToolCall``, ``ParsedTurn``.
- :mod:`.runner`: ``run_tool_calls`` (concurrent, time-limited, truncated, errors as messages).
- Built-in tools: :mod:`.gsm8k_tool`, :mod:`.python_tool`, :mod:`.search_tool` (BM25,
  :mod:`.bm25`), :mod:`.calculator_tool`.
- :mod:`.interactions`: ``BaseInteraction``, ``Gsm8kInteraction``, ``load_interactions``.

Importing this package is cheap: pydantic and PyYAML, no torch or transformers (``transformers``
only when a function tool's schema is inferred).
docs/tools.md lists the differences from verl.
"""

from __future__ import annotations

from megarl.tools.base_tool import BaseTool
from megarl.tools.errors import ToolConfigError
from megarl.tools.function_tool import FunctionTool
from megarl.tools.interactions.base import BaseInteraction
from megarl.tools.interactions.registry import load_interactions
from megarl.tools.parser import ParsedTurn, ToolCall, parse_tool_calls
from megarl.tools.registry import load_all_tools, load_tool_config
from megarl.tools.runner import ToolCallError, ToolCallResult, run_tool_calls
from megarl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = [
    "BaseInteraction",
    "BaseTool",
    "FunctionTool",
    "OpenAIFunctionToolSchema",
    "ParsedTurn",
    "ToolCall",
    "ToolCallError",
    "ToolCallResult",
    "ToolConfigError",
    "ToolResponse",
    "load_all_tools",
    "load_interactions",
    "load_tool_config",
    "parse_tool_calls",
    "run_tool_calls",
]
