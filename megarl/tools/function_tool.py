"""Function tools (``function_tool_path``), as verl 0.9.1's ``verl/tools/function_tool.py``.

A Python file whose functions carry ``@function_tool`` (bare, ``@function_tool("name")`` or
``@function_tool(schema=...)``) registers them; the OpenAI schema comes from the signature and
the Google-style docstring through ``transformers.utils.get_json_schema``, exactly as verl builds
it (so the same functions are refused: no docstring, a parameter without a type hint or without
an ``Args:`` line; ``*args``/``**kwargs`` are refused here as in verl). ``transformers`` is
imported only when a schema is inferred. A verl file changes
``from verl.tools.function_tool import function_tool`` to
``from megarl.tools.function_tool import function_tool``.

Function tools are stateless: no create/release, ``tools_kwargs`` are not passed (verl). A
function may be sync (run in a daemon thread of :func:`~megarl.tools.event_loop.tool_thread_pool`,
never joined: a time limit around the call holds whatever the event loop) or async; its return becomes ``(ToolResponse, reward,
metrics)`` by :func:`normalize_function_tool_return` (verl's rules).

Differences from verl: a file that fails to import, or registers no tool, is a
:class:`~megarl.tools.errors.ToolConfigError` naming the file (verl lets the import error
escape, and only warns about a file without tools).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.tools.errors import ToolConfigError
from megarl.tools.event_loop import to_tool_thread
from megarl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = [
    "FUNCTION_TOOL_REGISTRY",
    "FunctionTool",
    "function_tool",
    "get_function_tool",
    "load_function_tools_from_path",
    "normalize_function_tool_return",
]

FUNCTION_TOOL_REGISTRY: dict[str, FunctionTool] = {}
"""Every registered function tool by name (process-wide, as verl's)."""
_LOADED_PATHS: dict[str, list[FunctionTool]] = {}


@dataclass
class FunctionTool:
    """A registered function: its tool name, the callable, its schema, whether it is async."""

    name: str
    fn: Callable[..., Any]
    tool_schema: OpenAIFunctionToolSchema
    is_async: bool = False

    async def call(self, parameters: dict[str, Any]) -> Any:
        """Call the function with the model's arguments (a sync one in a daemon thread of
        :func:`~megarl.tools.event_loop.tool_thread_pool`)."""
        if self.is_async:
            return await self.fn(**parameters)
        return await to_tool_thread(self.fn, **parameters)


def function_tool(
    name: str | Callable | None = None,
    *,
    schema: OpenAIFunctionToolSchema | dict | None = None,
):
    """Register a function as a tool: ``@function_tool``, ``@function_tool("tool_name")`` or
    ``@function_tool(schema={...})`` (the schema as given, no inference). The function itself is
    returned unchanged. A second function under a registered name raises ``ValueError``."""

    def decorator_for(tool_name: str | None) -> Callable[[Callable], Callable]:
        def decorator(fn: Callable) -> Callable:
            resolved = tool_name or fn.__name__
            if isinstance(schema, OpenAIFunctionToolSchema):
                built = schema
            elif isinstance(schema, dict):
                built = OpenAIFunctionToolSchema.model_validate(schema)
            else:
                built = _schema_from_function(fn, resolved)
            existing = FUNCTION_TOOL_REGISTRY.get(resolved)
            if existing is not None and existing.fn is not fn:
                raise ValueError(
                    f"function tool {resolved!r} is already registered to "
                    f"{existing.fn.__module__}.{existing.fn.__qualname__}; refusing to overwrite "
                    f"it with {fn.__module__}.{fn.__qualname__}"
                )
            FUNCTION_TOOL_REGISTRY[resolved] = FunctionTool(
                resolved, fn, built, inspect.iscoroutinefunction(fn)
            )
            return fn

        return decorator

    if callable(name) and schema is None:
        return decorator_for(None)(name)
    return decorator_for(name if isinstance(name, str) else None)


def get_function_tool(name: str) -> FunctionTool:
    """The registered tool ``name`` (``KeyError`` naming ``function_tool_path`` if absent)."""
    if name not in FUNCTION_TOOL_REGISTRY:
        raise KeyError(
            f"function tool {name!r} is not registered: is its file the function_tool_path?"
        )
    return FUNCTION_TOOL_REGISTRY[name]


def _schema_from_function(fn: Callable, tool_name: str) -> OpenAIFunctionToolSchema:
    variadic = [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if variadic:
        raise ValueError(
            f"function tool {tool_name!r} ({fn.__module__}.{fn.__qualname__}) has variadic "
            f"parameter(s) {variadic}, which an OpenAI tool schema cannot express"
        )
    from transformers.utils import get_json_schema  # heavy: only when a schema is inferred

    raw = get_json_schema(fn)
    raw["function"]["name"] = tool_name
    return OpenAIFunctionToolSchema.model_validate(raw)


def load_function_tools_from_path(path: str | Path) -> list[FunctionTool]:
    """Run the Python file ``path`` once (later calls return the same tools) and return the tools
    it registered, in name order. The module is named after the file's absolute path and put in
    ``sys.modules``; nothing is added to ``sys.path`` (verl)."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ToolConfigError(f"function_tool_path={str(path)!r}: no such file")
    key = str(file)
    if key in _LOADED_PATHS:
        return _LOADED_PATHS[key]
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    module_name = (
        f"megarl_function_tools_{''.join(c if c.isalnum() else '_' for c in file.stem)}_{digest}"
    )
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ToolConfigError(f"function_tool_path={str(path)!r} is not a Python file")
    before = set(FUNCTION_TOOL_REGISTRY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        for name in set(FUNCTION_TOOL_REGISTRY) - before:
            del FUNCTION_TOOL_REGISTRY[name]
        hint = ""
        if isinstance(exc, ImportError) and (exc.name or "").startswith("verl"):
            hint = " (import function_tool from megarl.tools.function_tool instead of verl's)"
        message = str(exc).splitlines()[0] if str(exc) else ""
        raise ToolConfigError(
            f"function_tool_path={str(path)!r} failed to load: {type(exc).__name__}: {message}{hint}"
        ) from exc
    tools = [FUNCTION_TOOL_REGISTRY[name] for name in sorted(set(FUNCTION_TOOL_REGISTRY) - before)]
    if not tools:
        raise ToolConfigError(
            f"function_tool_path={str(path)!r} registers no tool: decorate its functions with "
            "@function_tool (from megarl.tools.function_tool)"
        )
    _LOADED_PATHS[key] = tools
    return tools


def normalize_function_tool_return(ret: Any) -> tuple[ToolResponse, float, dict]:
    """A function's return as ``(ToolResponse, reward, metrics)``, verl's rules:

    ``ToolResponse`` as is; ``str`` as its text; ``dict`` as its JSON (non-ASCII kept); a tuple
    ``(response,)``, ``(response, reward)`` or ``(response, reward, metrics)`` (reward None is
    0.0, metrics None is {}; any other length raises ``TypeError``); anything else as ``str()``.
    """
    if isinstance(ret, tuple):
        if not 1 <= len(ret) <= 3:
            raise TypeError(
                f"a function tool's tuple return must have 1, 2 or 3 entries "
                f"(response, reward, metrics), got {len(ret)}: {ret!r}"
            )
        reward = 0.0 if len(ret) < 2 or ret[1] is None else float(ret[1])
        metrics = {} if len(ret) < 3 or ret[2] is None else dict(ret[2])
        return _as_response(ret[0]), reward, metrics
    return _as_response(ret), 0.0, {}


def _as_response(value: Any) -> ToolResponse:
    if isinstance(value, ToolResponse):
        return value
    if isinstance(value, str):
        return ToolResponse(text=value)
    if isinstance(value, dict):
        return ToolResponse(text=json.dumps(value, ensure_ascii=False))
    return ToolResponse(text=str(value))
