"""Tool config files: verl's example files load onto megarl's built-ins; every bad file is one
line naming the file and the entry."""

from __future__ import annotations

import sys

import pytest

from megarl.tools.calculator_tool import CalculatorTool
from megarl.tools.errors import ToolConfigError
from megarl.tools.gsm8k_tool import Gsm8kTool
from megarl.tools.python_tool import PythonTool
from megarl.tools.registry import VERL_CLASS_PATHS, load_all_tools, load_tool_config
from megarl.tools.search_tool import LocalSearchTool

# verl's examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml, unchanged.
VERL_GSM8K_TOOL_CONFIG = """
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config: 
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if parsed answer is incorrect or not correctly parsed)"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""

# verl's sandbox_fusion_tool_config.yaml (the tool sends the code to that URL when it runs).
VERL_SANDBOX_TOOL_CONFIG = """
tools:
  - class_name: "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
    config:
      sandbox_fusion_url: "https://xxx.apigateway-cn-beijing.volceapi.com/run_code"
      num_workers: 10
      enable_global_rate_limit: true
      rate_limit: 10
      default_timeout: 30
      default_language: "python"
      memory_limit_mb: 1024
      type: native
    tool_schema:
      type: "function"
      function:
        name: "code_interpreter"
        description: "A tool for executing code."
        parameters:
          type: "object"
          properties:
            code:
              type: "string"
              description: "The code to execute."
          required: ["code"]
"""


def test_verl_example_tool_configs_load_onto_the_builtins(write):
    (gsm8k,) = load_tool_config(write("gsm8k.yaml", VERL_GSM8K_TOOL_CONFIG))
    assert isinstance(gsm8k, Gsm8kTool) and gsm8k.name == "calc_gsm8k_reward"
    (python,) = load_tool_config(write("sandbox.yaml", VERL_SANDBOX_TOOL_CONFIG))
    assert isinstance(python, PythonTool) and python.name == "code_interpreter"
    assert python.default_timeout == 30 and python.memory_limit_mb == 1024
    assert python.service.url == "https://xxx.apigateway-cn-beijing.volceapi.com/run_code"


def test_builtins_by_megarl_path_with_default_schemas(write, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "0", "contents": "\\"Paris\\"\\nCapital of France."}\n')
    config = write(
        "tools.yaml",
        f"""
        tools:
          - class_name: megarl.tools.calculator_tool.CalculatorTool
            config: {{}}
          - class_name: megarl.tools.search_tool.LocalSearchTool
            config: {{corpus_path: {corpus}, topk: 2}}
        """,
    )
    tools = load_all_tools(config, None)
    assert list(tools) == ["calculator", "search"]
    assert isinstance(tools["calculator"], CalculatorTool)
    assert isinstance(tools["search"], LocalSearchTool) and tools["search"].topk == 2


def test_every_mapped_verl_path_resolves():
    from megarl.tools.registry import resolve_class

    for verl_path in VERL_CLASS_PATHS:
        assert resolve_class(verl_path, "x").__module__.startswith("megarl.tools.")


NOT_A_TOOL = "class NotATool:\n    def __init__(self, config, tool_schema):\n        pass\n"
RAISES = (
    "from megarl.tools.base_tool import BaseTool\n"
    "class Broken(BaseTool):\n"
    "    def __init__(self, config, tool_schema):\n"
    "        raise RuntimeError('needs an API key\\nsecond line')\n"
)
SCHEMA = "tool_schema: {type: function, function: {name: f, description: d}}"

BAD_FILES = [
    ("tools: [", "not valid YAML"),
    ("other: []", "expected a top-level 'tools:' list"),
    ("tools:\n  - config: {}", "tools[0]: expected a mapping with class_name"),
    ("tools:\n  - class_name: verl.tools.geo3k_tool.Geo3kTool\n    " + SCHEMA,
     ("tools[0] (class_name 'verl.tools.geo3k_tool.Geo3kTool'): verl.tools.geo3k_tool.Geo3kTool "
     "is not built into megarl")),
    ("tools:\n  - class_name: no_such_pkg_xyz.Tool\n    " + SCHEMA,
     "cannot import module 'no_such_pkg_xyz': ModuleNotFoundError"),
    ("tools:\n  - class_name: megarl.tools.gsm8k_tool.Nope\n    " + SCHEMA,
     "module 'megarl.tools.gsm8k_tool' has no class 'Nope'"),
    ("tools:\n  - class_name: Gsm8kTool", "class_name must be a dotted path"),
    ("tools:\n  - class_name: bad_tools_mod.NotATool\n    " + SCHEMA,
     "is not a megarl.tools.BaseTool subclass"),
    ("tools:\n  - class_name: bad_tools_mod.Broken\n    " + SCHEMA,
     "(class_name 'bad_tools_mod.Broken'): RuntimeError: needs an API key"),
    (("tools:\n  - class_name: megarl.tools.gsm8k_tool.Gsm8kTool\n"
     "    tool_schema: {type: function, function: {description: d}}"),
     "tool_schema.function.name: Field required"),
    ("tools:\n  - class_name: megarl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: mcp}",
     "config.type='mcp' is not supported"),
    ("tools:\n  - class_name: megarl.tools.gsm8k_tool.Gsm8kTool\n    schema: {}",
     "unknown key(s) ['schema']"),
    (("tools:\n  - class_name: megarl.tools.gsm8k_tool.Gsm8kTool\n"
     "  - class_name: megarl.tools.gsm8k_tool.Gsm8kTool"),
     ("tools[1] (class_name 'megarl.tools.gsm8k_tool.Gsm8kTool'): a second tool named "
     "'calc_gsm8k_reward'")),
    (("tools:\n  - class_name: megarl.tools.search_tool.LocalSearchTool\n"
     "    config: {retrieval_service_url: 'http://127.0.0.1:8000/retrieve'}"),
     "ValueError: retrieval_service_url is not supported"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "expected"), BAD_FILES, ids=range(len(BAD_FILES)))
def test_a_bad_tool_config_is_one_line_naming_file_and_entry(text, expected, write, tmp_path,
                                                              monkeypatch):  # fmt: skip
    write("bad_tools_mod.py", NOT_A_TOOL + RAISES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "bad_tools_mod", raising=False)
    path = write("tools.yaml", text)
    with pytest.raises(ToolConfigError) as info:
        load_tool_config(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path)) and expected in message, message


def test_missing_file_names_the_setting(tmp_path):
    with pytest.raises(ToolConfigError, match=r"^tool_config_path='.*nope.yaml': no such file$"):
        load_tool_config(tmp_path / "nope.yaml")
