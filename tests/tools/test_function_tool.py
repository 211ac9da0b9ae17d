"""Function tools (``function_tool_path``): verl's decorator, schema inference through
transformers' ``get_json_schema``, file loading, return normalisation, name clashes."""

from __future__ import annotations

import pytest

from megarl.tools import function_tool as function_tool_module
from megarl.tools.errors import ToolConfigError
from megarl.tools.function_tool import (
    FUNCTION_TOOL_REGISTRY,
    function_tool,
    load_function_tools_from_path,
    normalize_function_tool_return,
)
from megarl.tools.parser import ToolCall
from megarl.tools.registry import load_all_tools
from megarl.tools.runner import ToolCallError, run_tool_calls
from megarl.tools.schemas import ToolResponse
from tests.tools.conftest import run

# A verl function-tool file, with only its import changed from verl.tools.function_tool.
FUNCTION_FILE = '''
from typing import Literal

from megarl.tools.function_tool import function_tool


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


@function_tool("lookup")
async def _lookup(key: str, mode: Literal["exact", "prefix"] = "exact") -> str:
    """Look a key up.

    Args:
        key: The key.
        mode: How to match.
    """
    return {"x": 1, "mode": mode}
'''


@pytest.fixture(autouse=True)
def _clean_registry():
    FUNCTION_TOOL_REGISTRY.clear()
    function_tool_module._LOADED_PATHS.clear()
    yield
    FUNCTION_TOOL_REGISTRY.clear()
    function_tool_module._LOADED_PATHS.clear()


def test_a_function_tool_file_loads_with_verl_schemas_and_runs(write):
    path = write("fns.py", FUNCTION_FILE)
    tools = load_function_tools_from_path(path)
    assert [t.name for t in tools] == ["add", "lookup"]
    assert load_function_tools_from_path(path) is tools  # loaded once
    add = tools[0].tool_schema.model_dump(exclude_unset=True, exclude_none=True)["function"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["properties"]["a"] == {
        "type": "integer",
        "description": "The first integer.",
    }
    assert add["parameters"]["required"] == ["a", "b"]
    lookup = tools[1].tool_schema.function.parameters.properties["mode"]
    assert lookup.enum == ["exact", "prefix"] and tools[1].is_async

    calls = [ToolCall("add", '{"a": 2, "b": 40}'), ToolCall("lookup", '{"key": "x"}')]
    by_name = {t.name: t for t in tools}
    results = run(run_tool_calls(calls, by_name, max_parallel_calls=2))
    assert [(r.text, r.reward, r.error) for r in results] == [
        ("42", 0.0, ToolCallError.NONE),
        ('{"x": 1, "mode": "exact"}', 0.0, ToolCallError.NONE),
    ]
    bad = run(run_tool_calls([ToolCall("add", '{"a": 2}')], by_name))[0]
    assert (
        bad.error is ToolCallError.RAISED and "missing 1 required positional argument" in bad.text
    )


def test_schema_inference_refuses_what_verl_refuses():
    with pytest.raises(Exception, match="no docstring"):

        @function_tool
        def undocumented(x: int) -> int:
            return x

    with pytest.raises(ValueError, match="variadic"):

        @function_tool
        def variadic(*args: int) -> int:
            """Sum.

            Args:
                args: Numbers.
            """

    with pytest.raises(ValueError, match="already registered"):

        @function_tool(
            name="dup", schema={"type": "function", "function": {"name": "dup", "description": "d"}}
        )
        def first() -> None: ...

        @function_tool(
            name="dup", schema={"type": "function", "function": {"name": "dup", "description": "d"}}
        )
        def second() -> None: ...


def test_return_values_are_normalised_as_verl():
    response = ToolResponse(text="r")
    assert normalize_function_tool_return(response) == (response, 0.0, {})
    assert normalize_function_tool_return({"é": 1})[0].text == '{"é": 1}'
    assert normalize_function_tool_return(("t", None, None)) == (ToolResponse(text="t"), 0.0, {})
    assert normalize_function_tool_return(("t", 0.5, {"m": 1})) == (
        ToolResponse(text="t"),
        0.5,
        {"m": 1},
    )
    assert normalize_function_tool_return(7)[0].text == "7"
    with pytest.raises(TypeError, match="1, 2 or 3 entries"):
        normalize_function_tool_return(())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("from verl.tools.function_tool import function_tool\n",
         ("ModuleNotFoundError: No module named 'verl' (import function_tool from "
         "megarl.tools.function_tool instead of verl's)")),
        ("x = 1\n", "registers no tool: decorate its functions with @function_tool"),
        ("raise RuntimeError('boom')\n", "failed to load: RuntimeError: boom"),
    ],
)  # fmt: skip
def test_a_bad_function_tool_file_is_one_line(text, expected, write):
    path = write("bad_fns.py", text)
    with pytest.raises(ToolConfigError) as info:
        load_function_tools_from_path(path)
    assert str(info.value).startswith(f"function_tool_path={str(path)!r}")
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_a_function_tool_named_like_a_configured_tool_is_refused(write):
    config = write(
        "tools.yaml", "tools:\n  - class_name: megarl.tools.calculator_tool.CalculatorTool\n"
    )
    fns = write(
        "fns.py",
        '''
        from megarl.tools.function_tool import function_tool

        @function_tool
        def calculator(expression: str) -> str:
            """Calculate.

            Args:
                expression: What.
            """
            return expression
        ''',
    )
    with pytest.raises(
        ToolConfigError, match=r"tool name\(s\) \['calculator'\] also in tool_config_path"
    ):
        load_all_tools(config, fns)
