"""Loading tools: verl's tool config YAML (``tool_config_path``) and function tools
(``function_tool_path``), as verl 0.9.1's ``verl/tools/tool_registry.py``.

The YAML file is ``{"tools": [{"class_name": ..., "config": {...}, "tool_schema": {...}}, ...]}``.
Each class is imported by its dotted path and built as ``cls(config=<dict>,
tool_schema=<OpenAIFunctionToolSchema or None>)``. verl's own tools are mapped onto megarl's
built-in equivalents (:data:`VERL_CLASS_PATHS`), so verl's example files load unchanged; any
other ``verl.*`` path is refused.

Every problem is one :class:`~megarl.tools.errors.ToolConfigError` line naming the file and the
entry (``tools[2] (class_name 'pkg.mod.Cls')``). Differences from verl: ``config.type`` may be
left out (verl requires ``native``, the only type it has; another value is refused as in verl);
the YAML is read with PyYAML, so OmegaConf's ``${...}`` interpolations are not resolved; two
tools of one name are refused (verl keeps the last native one silently).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from megarl.tools.base_tool import BaseTool
from megarl.tools.errors import ToolConfigError
from megarl.tools.function_tool import FunctionTool, load_function_tools_from_path
from megarl.tools.schemas import OpenAIFunctionToolSchema

__all__ = [
    "VERL_CLASS_PATHS",
    "load_all_tools",
    "load_tool_config",
    "read_yaml_list",
    "resolve_class",
]

VERL_CLASS_PATHS: dict[str, str] = {
    "verl.tools.gsm8k_tool.Gsm8kTool": "megarl.tools.gsm8k_tool.Gsm8kTool",
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "megarl.tools.python_tool.PythonTool",
    "verl.tools.search_tool.SearchTool": "megarl.tools.search_tool.LocalSearchTool",
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": (
        "megarl.tools.interactions.gsm8k_interaction.Gsm8kInteraction"
    ),
}
"""verl class paths (tools and interactions) → the megarl built-in that takes their place."""


def read_yaml_list(path: str | Path, key: str, label: str) -> tuple[Path, list[Any]]:
    """The list under ``key`` in the YAML file ``path`` (``label`` names the setting)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ToolConfigError(f"{label}={str(path)!r}: no such file")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        first = str(exc).replace("\n", " ")
        raise ToolConfigError(f"{file}: not valid YAML: {first}") from exc
    if not isinstance(data, Mapping) or not isinstance(data.get(key), list):
        raise ToolConfigError(f"{file}: expected a top-level '{key}:' list")
    return file, data[key]


def resolve_class(dotted: str, where: str) -> type:
    """The class at ``pkg.module.Class`` (a verl built-in's megarl equivalent for the verl paths
    of :data:`VERL_CLASS_PATHS`); ``where`` prefixes every error."""
    if not isinstance(dotted, str) or "." not in dotted:
        raise ToolConfigError(f"{where}: class_name must be a dotted path pkg.module.Class")
    target = VERL_CLASS_PATHS.get(dotted, dotted)
    if target.split(".", 1)[0] == "verl":
        built = ", ".join(sorted(VERL_CLASS_PATHS))
        raise ToolConfigError(f"{where}: {dotted} is not built into megarl (mapped: {built})")
    module_name, class_name = target.rsplit(".", 1)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        message = str(exc).splitlines()[0] if str(exc) else ""
        raise ToolConfigError(
            f"{where}: cannot import module {module_name!r}: {type(exc).__name__}: {message}"
        ) from exc
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ToolConfigError(f"{where}: module {module_name!r} has no class {class_name!r}")
    return cls


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(part) for part in err["loc"])
    return f"{loc}: {err['msg']}" if loc else err["msg"]


def load_tool_config(path: str | Path) -> list[BaseTool]:
    """The tools of the tool config file ``path``, built, in file order."""
    file, entries = read_yaml_list(path, "tools", "tool_config_path")
    tools: list[BaseTool] = []
    for index, entry in enumerate(entries):
        where = f"{file}: tools[{index}]"
        if not isinstance(entry, Mapping) or "class_name" not in entry:
            raise ToolConfigError(
                f"{where}: expected a mapping with class_name, config, tool_schema"
            )
        where += f" (class_name {entry['class_name']!r})"
        unknown = sorted(set(entry) - {"class_name", "config", "tool_schema"})
        if unknown:
            raise ToolConfigError(f"{where}: unknown key(s) {unknown}")
        config = entry.get("config") or {}
        if not isinstance(config, Mapping):
            raise ToolConfigError(f"{where}: config must be a mapping")
        if config.get("type", "native") != "native":
            raise ToolConfigError(
                f"{where}: config.type={config['type']!r} is not supported (only 'native', as verl 0.9.1)"
            )
        schema = None
        if entry.get("tool_schema") is not None:
            try:
                schema = OpenAIFunctionToolSchema.model_validate(entry["tool_schema"])
            except ValidationError as exc:
                raise ToolConfigError(f"{where}: tool_schema.{_first_error(exc)}") from exc
        cls = resolve_class(entry["class_name"], where)
        if not issubclass(cls, BaseTool):
            raise ToolConfigError(
                f"{where}: {cls.__module__}.{cls.__qualname__} is not a megarl.tools.BaseTool "
                "subclass (a verl tool imports BaseTool from megarl.tools.base_tool instead)"
            )
        try:
            tool = cls(config=dict(config), tool_schema=schema)
        except Exception as exc:
            message = str(exc).splitlines()[0] if str(exc) else ""
            raise ToolConfigError(f"{where}: {type(exc).__name__}: {message}") from exc
        if any(t.name == tool.name for t in tools):
            raise ToolConfigError(f"{where}: a second tool named {tool.name!r}")
        tools.append(tool)
    return tools


def load_all_tools(
    tool_config_path: str | Path | None, function_tool_path: str | Path | None
) -> dict[str, BaseTool | FunctionTool]:
    """Every configured tool by name: the tool config's, then the function tools (a name in
    both is refused, as in verl)."""
    tools: dict[str, BaseTool | FunctionTool] = {}
    if tool_config_path:
        tools.update((tool.name, tool) for tool in load_tool_config(tool_config_path))
    if function_tool_path:
        functions = load_function_tools_from_path(function_tool_path)
        clash = sorted(f.name for f in functions if f.name in tools)
        if clash:
            raise ToolConfigError(
                f"function_tool_path={str(function_tool_path)!r}: tool name(s) {clash} also in "
                f"tool_config_path={str(tool_config_path)!r}; each tool name must be unique"
            )
        tools.update((f.name, f) for f in functions)
    return tools
