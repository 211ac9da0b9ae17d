"""Running one turn's tool calls: concurrently, each with a time limit, output truncated, every
failure turned into a message for the model (no exception escapes for a bad call or a bad tool).

Per call, as verl 0.9.1's ``ToolAgentLoop._call_tool``: an unknown name or arguments that are not
a JSON object are answered without running anything; a function tool is called directly (no
lifecycle, ``tools_kwargs`` not passed); a :class:`~megarl.tools.base_tool.BaseTool` gets a fresh
instance (``create(create_kwargs=tools_kwargs[name]["create_kwargs"])``), ``execute`` and
``release``; only the first ``max_parallel_calls`` calls run, the others get no result; the
text is truncated to ``max_tool_response_length`` characters (:func:`truncate_tool_response`).

Additions to verl (its loop has none of these): a time limit per call (``timeout_s``: create and
execute; a tool that runs past it is cancelled, its instance still released; a thread cannot be
stopped: a synchronous function tool's runs on in a daemon thread of
:func:`~megarl.tools.event_loop.tool_thread_pool`, its result ignored, and nothing joins it, so
the limit bounds the turn; a tool's own ``asyncio.to_thread`` is as safe only under a
:class:`~megarl.tools.event_loop.ToolEventLoop`, whose default executor that pool is, not under
``asyncio.run``, which joins its pool at the end);
malformed calls from the parser answered with an error message; an exception from ``create``,
``release`` or a wrongly shaped ``execute`` return handled; and trajectory-scoped instances
(``instance_ids`` from :func:`create_instances`: state kept across calls, ``calc_reward`` at the
end, as verl's older SGLang rollout did). Tools must not block the event loop: a blocking
``execute`` stalls every call of the turn and the time limit cannot interrupt it (megarl's
built-in tools run their blocking work in the pool: ``to_tool_thread``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from megarl.tools.base_tool import BaseTool
from megarl.tools.function_tool import FunctionTool, normalize_function_tool_return
from megarl.tools.parser import ToolCall
from megarl.tools.schemas import ToolResponse

__all__ = [
    "TRUNCATE_SIDES",
    "ToolCallError",
    "ToolCallResult",
    "calc_rewards",
    "create_instances",
    "release_instances",
    "run_tool_calls",
    "tool_call_metrics",
    "truncate_tool_response",
]

logger = logging.getLogger(__name__)

TRUNCATE_SIDES = ("left", "middle", "right")


class ToolCallError(StrEnum):
    """What went wrong with a call."""

    NONE = "none"
    MALFORMED = "malformed"  # the call could not be read, or its arguments are not a JSON object
    UNKNOWN = "unknown"  # no tool of that name
    RAISED = "raised"  # create/execute raised, or execute returned the wrong shape
    TIMEOUT = "timeout"  # create + execute ran past timeout_s


@dataclass(frozen=True)
class ToolCallResult:
    """The outcome of one call: what the tool turn shows the model, and what the metrics count."""

    name: str
    """The called name ("" for a call too malformed to name one)."""
    text: str
    """The tool turn's text, truncated (an error's message when ``error`` is not NONE)."""
    reward: float | None
    """The step reward ``execute`` returned (None: none; 0.0 on an error, as verl)."""
    metrics: dict[str, Any]
    """The tool's own metrics ({} on an error)."""
    error: ToolCallError
    seconds: float
    """Wall time of create + execute (or of the function call)."""
    response: ToolResponse = field(default_factory=ToolResponse)
    """The full response with ``text`` truncated (images and videos kept)."""
    tool_call_id: str | None = None


def truncate_tool_response(text: str, max_length: int, side: str = "middle") -> str:
    """``text`` cut to ``max_length`` characters plus a marker, as verl 0.9.1: ``left`` drops
    the start (``"(truncated)..." + last``), ``right`` drops the end (``first +
    "...(truncated)"``), ``middle`` keeps ``max_length // 2`` characters of each end around
    ``"...(truncated)..."``. (verl before 0.9 named left and right the other way round.)"""
    if side not in TRUNCATE_SIDES:
        raise ValueError(
            f"tool_response_truncate_side must be one of {TRUNCATE_SIDES}, got {side!r}"
        )
    if len(text) <= max_length:
        return text
    if side == "left":
        return "(truncated)..." + text[len(text) - max_length :]
    if side == "right":
        return text[:max_length] + "...(truncated)"
    half = max_length // 2
    return text[:half] + "...(truncated)..." + (text[len(text) - half :] if half else "")


def _create_kwargs(tools_kwargs: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    entry = (tools_kwargs or {}).get(name) or {}
    return dict(entry.get("create_kwargs") or {})


class _ToolTimeoutError(Exception):
    """A TimeoutError the tool itself raised (so it is not taken for the call's time limit)."""


def _check_execute_return(ret: Any) -> tuple[ToolResponse, float | None, dict]:
    if not (isinstance(ret, tuple) and len(ret) == 3 and isinstance(ret[0], ToolResponse)):
        raise TypeError(
            f"execute returned {type(ret).__name__}, expected (ToolResponse, reward, metrics)"
        )
    response, reward, metrics = ret
    return response, None if reward is None else float(reward), dict(metrics or {})


async def _invoke(
    tool: BaseTool | FunctionTool,
    arguments: dict[str, Any],
    create_kwargs: dict[str, Any],
    instance_id: str | None,
    created: list[str],
    execute_kwargs: Mapping[str, Any],
) -> tuple[ToolResponse, float | None, dict]:
    try:
        if isinstance(tool, FunctionTool):
            return normalize_function_tool_return(await tool.call(arguments))
        if instance_id is None:
            instance_id, _ = await tool.create(create_kwargs=create_kwargs)
            created.append(instance_id)
        return _check_execute_return(await tool.execute(instance_id, arguments, **execute_kwargs))
    except TimeoutError as exc:
        raise _ToolTimeoutError(f"TimeoutError: {_one_line(exc)}") from exc


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


async def _run_one(
    call: ToolCall,
    tools: Mapping[str, BaseTool | FunctionTool],
    tools_kwargs: Mapping[str, Any] | None,
    instance_ids: Mapping[str, str] | None,
    timeout_s: float | None,
    execute_kwargs: Mapping[str, Any],
) -> tuple[ToolResponse, float | None, dict, ToolCallError, float]:
    start = time.perf_counter()

    def failed(kind: ToolCallError, text: str) -> tuple:
        # As verl's loop (logger.warning of each failed call): the text the model gets, also
        # in the rank's log, where the step's tool_errors count alone did not say what failed.
        logger.warning("tool call %r failed (%s): %s", call.name, kind.value, text)
        return ToolResponse(text=text), 0.0, {}, kind, time.perf_counter() - start

    if call.error is not None:
        return failed(ToolCallError.MALFORMED, f"Malformed tool call: {call.error}")
    if call.name not in tools:
        return failed(
            ToolCallError.UNKNOWN,
            f"Unknown function '{call.name}'. Available tools: {sorted(tools)}",
        )
    try:
        arguments = json.loads(call.arguments)
    except (json.JSONDecodeError, TypeError) as exc:
        return failed(
            ToolCallError.MALFORMED, f"Invalid JSON in arguments for '{call.name}': {exc}"
        )
    if not isinstance(arguments, dict):
        return failed(ToolCallError.MALFORMED, f"Arguments for '{call.name}' must be a JSON object")
    tool = tools[call.name]
    created: list[str] = []
    shared = (instance_ids or {}).get(call.name)
    try:
        response, reward, metrics = await asyncio.wait_for(
            _invoke(
                tool, arguments, _create_kwargs(tools_kwargs, call.name), shared, created,
                execute_kwargs,
            ),
            timeout_s,
        )  # fmt: skip
        return response, reward, metrics, ToolCallError.NONE, time.perf_counter() - start
    except TimeoutError:
        return failed(
            ToolCallError.TIMEOUT,
            f"Error executing tool '{call.name}': timed out after {timeout_s:g} s",
        )
    except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's error message
        return failed(ToolCallError.RAISED, f"Error executing tool '{call.name}': {_one_line(exc)}")
    finally:
        for instance_id in created:
            await _release_quietly(tool, instance_id, timeout_s)


async def _release_quietly(tool: BaseTool, instance_id: str, timeout_s: float | None) -> None:
    try:
        await asyncio.wait_for(tool.release(instance_id), timeout_s)
    except Exception as exc:  # noqa: BLE001 - a failed release must not undo a call's result
        logger.warning("tool %r: release(%s) failed: %s", tool.name, instance_id, _one_line(exc))


async def run_tool_calls(
    calls: Sequence[ToolCall],
    tools: Mapping[str, BaseTool | FunctionTool],
    *,
    tools_kwargs: Mapping[str, Any] | None = None,
    instance_ids: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    max_parallel_calls: int = 1,
    max_tool_response_length: int = 256,
    tool_response_truncate_side: str = "middle",
    execute_kwargs: Mapping[str, Any] | None = None,
) -> list[ToolCallResult]:
    """Run the first ``max_parallel_calls`` of ``calls`` concurrently; one result each, in order.

    ``tools``: name → tool (:func:`megarl.tools.registry.load_all_tools`); ``tools_kwargs``: the
    sample's ``extra_info.tools_kwargs``; ``instance_ids``: name → instance of a trajectory-scoped
    run (:func:`create_instances`), None for verl's instance per call; ``timeout_s``: limit per
    call (None: none); ``execute_kwargs``: extra keywords of every ``execute`` (verl passes
    ``agent_data``). Defaults are verl's ``multi_turn`` defaults.
    """
    if max_parallel_calls < 1:
        raise ValueError(f"max_parallel_calls must be >= 1, got {max_parallel_calls}")
    if tool_response_truncate_side not in TRUNCATE_SIDES:
        raise ValueError(
            f"tool_response_truncate_side must be one of {TRUNCATE_SIDES}, "
            f"got {tool_response_truncate_side!r}"
        )
    chosen = list(calls)[:max_parallel_calls]
    outcomes = await asyncio.gather(
        *(
            _run_one(call, tools, tools_kwargs, instance_ids, timeout_s, execute_kwargs or {})
            for call in chosen
        )
    )
    results = []
    for call, (response, reward, metrics, error, seconds) in zip(chosen, outcomes, strict=True):
        text = truncate_tool_response(
            response.text or "", max_tool_response_length, tool_response_truncate_side
        )
        results.append(
            ToolCallResult(
                name=call.name,
                text=text,
                reward=reward,
                metrics=metrics,
                error=error,
                seconds=seconds,
                response=response.model_copy(update={"text": text}),
                tool_call_id=call.tool_call_id,
            )
        )
    return results


async def create_instances(
    tools: Mapping[str, BaseTool | FunctionTool], tools_kwargs: Mapping[str, Any] | None = None
) -> dict[str, str]:
    """One instance per stateful tool for a whole trajectory (name → instance id), each created
    with its ``create_kwargs``; function tools have none."""
    names = [name for name, tool in tools.items() if isinstance(tool, BaseTool)]
    created = await asyncio.gather(
        *(tools[name].create(create_kwargs=_create_kwargs(tools_kwargs, name)) for name in names)
    )
    return {name: instance_id for name, (instance_id, _) in zip(names, created, strict=True)}


async def calc_rewards(
    tools: Mapping[str, BaseTool | FunctionTool], instance_ids: Mapping[str, str]
) -> dict[str, float]:
    """``calc_reward`` of each trajectory-scoped instance (name → reward; verl's
    ``rollout_reward_scores``)."""
    names = list(instance_ids)
    rewards = await asyncio.gather(*(tools[n].calc_reward(instance_ids[n]) for n in names))
    return dict(zip(names, rewards, strict=True))


async def release_instances(
    tools: Mapping[str, BaseTool | FunctionTool],
    instance_ids: Mapping[str, str],
    timeout_s: float | None = None,
) -> None:
    """Release every trajectory-scoped instance (a failing release is logged, not raised)."""
    await asyncio.gather(
        *(_release_quietly(tools[n], i, timeout_s) for n, i in instance_ids.items())
    )


def tool_call_metrics(results: Sequence[ToolCallResult]) -> dict[str, float]:
    """Counts for the step's metrics: calls, errors of each kind, seconds (sum)."""
    out: dict[str, float] = {"tool/calls": float(len(results))}
    for kind in ToolCallError:
        if kind is not ToolCallError.NONE:
            out[f"tool/errors/{kind.value}"] = float(sum(r.error is kind for r in results))
    out["tool/seconds"] = float(sum(r.seconds for r in results))
    return out
