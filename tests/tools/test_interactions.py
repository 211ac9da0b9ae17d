"""Interactions: verl's interaction YAML, BaseInteraction's API, the GSM8K feedback user."""

from __future__ import annotations

import sys

import pytest

from megarl.tools.errors import ToolConfigError
from megarl.tools.interactions.base import BaseInteraction
from megarl.tools.interactions.gsm8k_interaction import CORRECT, INCORRECT, Gsm8kInteraction
from megarl.tools.interactions.registry import load_interactions
from tests.tools.conftest import run

# verl's examples/sglang_multiturn/config/interaction_config/gsm8k_interaction_config.yaml
VERL_INTERACTION_CONFIG = """
interaction:
  - name: "gsm8k"
    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
    config: {}
"""

# An interaction written as a verl user would, with only its import changed.
USER_INTERACTION = """
from typing import Any, Optional
from uuid import uuid4

from megarl.tools.interactions.base import BaseInteraction


class EchoInteraction(BaseInteraction):
    def __init__(self, config: dict):
        super().__init__(config)
        self.turns = {}

    async def start_interaction(self, instance_id: Optional[str] = None, **kwargs) -> str:
        instance_id = instance_id or str(uuid4())
        self.turns[instance_id] = 0
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        self.turns[instance_id] += 1
        done = self.turns[instance_id] >= self.config["max_turns"]
        return done, f"you said: {messages[-1]['content']}", 0.5, {"turn": self.turns[instance_id]}
"""


def test_verl_example_interaction_config_gives_feedback_until_right(write):
    interactions = load_interactions(write("interaction.yaml", VERL_INTERACTION_CONFIG))
    gsm8k = interactions["gsm8k"]
    assert isinstance(gsm8k, Gsm8kInteraction) and gsm8k.name == "gsm8k"

    async def scenario():
        kwargs = {"name": "gsm8k", "query": "q", "ground_truth": "72"}  # verl's interaction_kwargs
        instance_id = await gsm8k.start_interaction("req-1", **kwargs)
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "#### 70"}]
        wrong = await gsm8k.generate_response(instance_id, messages, **kwargs)
        messages += [
            {"role": "user", "content": wrong[1]},
            {"role": "assistant", "content": "#### 72"},
        ]
        right = await gsm8k.generate_response(instance_id, messages, **kwargs)
        await gsm8k.finalize_interaction(instance_id)
        return instance_id, wrong, right

    instance_id, wrong, right = run(scenario())
    assert instance_id == "req-1"
    assert wrong == (False, INCORRECT, 0.0, {})
    assert right == (True, CORRECT, 1.0, {})
    assert gsm8k._instances == {}


def test_a_user_interaction_gets_its_derived_name(write, tmp_path, monkeypatch):
    write("user_interactions_mod.py", USER_INTERACTION)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_interactions_mod", raising=False)
    config = write(
        "i.yaml",
        """
        interaction:
          - class_name: user_interactions_mod.EchoInteraction
            config: {max_turns: 2}
        """,
    )
    ((name, echo),) = load_interactions(config).items()
    assert name == "echo" and echo.config == {"max_turns": 2, "name": "echo"}

    async def scenario():
        instance_id = await echo.start_interaction()
        messages = [{"role": "assistant", "content": "hi"}]
        return [await echo.generate_response(instance_id, messages) for _ in range(2)]

    assert run(scenario()) == [
        (False, "you said: hi", 0.5, {"turn": 1}),
        (True, "you said: hi", 0.5, {"turn": 2}),
    ]


def test_base_interaction_defaults_are_verls():
    base = BaseInteraction({})
    assert base.name == "interaction_agent"
    instance_id = run(base.start_interaction())
    assert len(instance_id) == 36
    assert run(base.generate_response(instance_id, [])) == (
        False, "Your current result seems acceptable.", 0.8, {}
    )  # fmt: skip
    assert run(base.calculate_score()) == 0.0 and run(base.calculate_score(instance_id)) == 0.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("interactions: []", "expected a top-level 'interaction:' list"),
        ("interaction:\n  - name: a", "interaction[0]: expected a mapping with class_name"),
        ("interaction:\n  - class_name: megarl.tools.gsm8k_tool.Gsm8kTool",
         "is not a megarl BaseInteraction subclass"),
        ("interaction:\n  - class_name: verl.interactions.weather_interaction.WeatherInteraction",
         "is not built into megarl"),
        (("interaction:\n"
         "  - class_name: megarl.tools.interactions.gsm8k_interaction.Gsm8kInteraction\n"
         "  - class_name: megarl.tools.interactions.gsm8k_interaction.Gsm8kInteraction"),
         ("interaction[1] (class_name 'megarl.tools.interactions.gsm8k_interaction."
         "Gsm8kInteraction'): a second interaction named 'gsm8k'")),
    ],
)  # fmt: skip
def test_a_bad_interaction_config_is_one_line(text, expected, write):
    path = write("i.yaml", text)
    with pytest.raises(ToolConfigError) as info:
        load_interactions(path)
    assert str(info.value).startswith(str(path)) and expected in str(info.value)
    assert "\n" not in str(info.value)
