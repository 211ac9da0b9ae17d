"""Checks of ``actor_rollout_ref.rollout.multi_turn.*`` (multi-turn rollouts with tools and
interactions: :mod:`megarl.rollout.multi_turn`), each problem one line naming its key."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from megarl.config.layout_checks import fmt_value

__all__ = ["FORMATS", "check_multi_turn"]

Error = Callable[[str], None]

MT = "actor_rollout_ref.rollout.multi_turn"
FORMATS = ("hermes",)
"""Tool-call formats built (:data:`megarl.tools.parser.FORMATS`)."""


def check_multi_turn(cfg, error: Error, problem: Error) -> None:
    """Report what megarl cannot do with the multi-turn settings through ``error``; a missing
    tool or interaction file through ``problem`` (an error when paths are checked)."""
    arr = cfg.actor_rollout_ref
    mt = arr.rollout.multi_turn
    for key, value in (("max_assistant_turns", mt.max_assistant_turns),
                       ("max_user_turns", mt.max_user_turns),
                       ("max_parallel_calls", mt.max_parallel_calls),
                       ("max_tool_response_length", mt.max_tool_response_length),
                       ("tool_call_timeout_s", mt.tool_call_timeout_s)):  # fmt: skip
        if value is not None and (isinstance(value, bool) or value <= 0):
            error(f"{MT}.{key}={fmt_value(value)} must be positive")
    if mt.format not in FORMATS:
        error(f"{MT}.format={fmt_value(mt.format)} is not built; use {' or '.join(FORMATS)}")
    if mt.use_inference_chat_template:
        error(
            f"{MT}.use_inference_chat_template=true is not built: trajectories keep the "
            "template's own ids for every turn; use false"
        )
    if mt.num_repeat_rollouts is not None:
        error(f"{MT}.num_repeat_rollouts is verl's SGLang-only option; leave it unset")
    for key in ("tool_config_path", "function_tool_path", "interaction_config_path"):
        path = getattr(mt, key)
        if path and not Path(path).expanduser().is_file():
            problem(f"{MT}.{key}={path!r} does not exist")
    for key in ("tool_config_path", "function_tool_path"):  # the prompt filter's tools
        path = getattr(cfg.data, key)
        if path and not Path(path).expanduser().is_file():
            problem(f"data.{key}={path!r} does not exist")
    if not mt.enable:
        return
    if not (mt.tool_config_path or mt.function_tool_path or mt.interaction_config_path):
        error(
            f"{MT}.enable=true needs {MT}.tool_config_path, function_tool_path or "
            "interaction_config_path (without tools or interactions a rollout is one turn)"
        )
