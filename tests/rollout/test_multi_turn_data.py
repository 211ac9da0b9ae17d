"""``data.tool_config_path`` / ``data.function_tool_path`` (verl's ``RLHFDataset``): with
``data.filter_overlong_prompts`` a prompt is counted as the chat template renders it with the
tools' schemas (the multi-turn loop renders it so); each path defaults to the rollout's
``multi_turn`` one, as verl's ``oc.select`` default. The kept prompts' ids stay the template's
without tools, as verl's ``raw_prompt_ids``."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.config import load_config
from megarl.data import PromptDataset
from megarl.models.tiny import CHAT_TEMPLATE, build_tokenizer
from megarl.rollout.multi_turn import tool_schema
from megarl.rollout.multi_turn_rollout import prompt_tool_schemas
from megarl.tools.calculator_tool import CalculatorTool

FUNCTIONS = '''
from megarl.tools.function_tool import function_tool


@function_tool
def shout(text: str) -> str:
    """Repeat a text in capitals.

    Args:
        text: what to repeat
    """
    return text.upper()
'''


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny tokenizer with a template that writes the tools into a system turn (as Qwen's;
    the tiny one ignores them)."""
    tok = build_tokenizer(1000)
    tok.chat_template = (
        "{% if tools %}{{ '<|im_start|>system\\n' }}{% for t in tools %}{{ t | tojson }}"
        "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}" + CHAT_TEMPLATE
    )
    return tok


def _rows(n: int) -> list[dict]:
    return [
        {
            "data_source": "t",
            "prompt": [{"role": "user", "content": "add " + "1 " * (8 * i)}],
            "reward_model": {"ground_truth": "1"},
        }
        for i in range(n)
    ]


def _config(tmp_path, *extra: str):
    pq.write_table(pa.Table.from_pylist(_rows(6)), tmp_path / "train.parquet")
    (tmp_path / "tools.yaml").write_text(
        "tools:\n  - class_name: megarl.tools.calculator_tool.CalculatorTool\n    config: {}\n"
    )
    (tmp_path / "functions.py").write_text(FUNCTIONS)
    return load_config(
        ["configs/_tiny_cpu.yaml"],
        [f"data.train_files={tmp_path / 'train.parquet'}", "data.filter_overlong_prompts=true",
         *extra],
    )  # fmt: skip


def _length(tokenizer, messages, tools) -> int:
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_the_overlong_filter_counts_a_prompt_with_the_tools_schemas(tmp_path, tokenizer):
    cfg = _config(
        tmp_path,
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
    )
    schemas = prompt_tool_schemas(cfg)  # data.tool_config_path unset: the rollout's
    assert schemas == [tool_schema(CalculatorTool({}, None))]
    messages = [r["prompt"] for r in _rows(6)]
    plain = [_length(tokenizer, m, None) for m in messages]
    tooled = [_length(tokenizer, m, schemas) for m in messages]
    limit = sorted(tooled)[2]  # keeps 3 prompts with the tools, all 6 without
    assert max(plain) <= limit < sorted(tooled)[3]
    common = {"max_prompt_length": limit, "filter_overlong_prompts": True}
    without = PromptDataset(str(tmp_path / "train.parquet"), tokenizer, **common)
    with_tools = PromptDataset(
        str(tmp_path / "train.parquet"), tokenizer, tool_schemas=schemas, **common
    )
    assert len(without) == 6
    assert [s.raw_prompt for s in with_tools] == [m for m, n in zip(messages, tooled) if n <= limit]
    assert [len(s.prompt_ids) for s in with_tools] == plain[:3]  # ids without the tools


def test_data_paths_override_the_rollouts_and_function_tools_count(tmp_path):
    cfg = _config(
        tmp_path,
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
        f"data.function_tool_path={tmp_path / 'functions.py'}",
    )
    names = [s["function"]["name"] for s in prompt_tool_schemas(cfg)]
    assert names == ["calculator", "shout"]
    cfg = _config(tmp_path, f"data.tool_config_path={tmp_path / 'tools.yaml'}")
    assert [s["function"]["name"] for s in prompt_tool_schemas(cfg)] == ["calculator"]
    off = _config(tmp_path, f"data.tool_config_path={tmp_path / 'tools.yaml'}",
                  "data.filter_overlong_prompts=false")  # fmt: skip
    assert prompt_tool_schemas(off) is None
