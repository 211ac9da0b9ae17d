"""Tool-call parsing of one model turn (``multi_turn.format``): ``hermes``, the Qwen2.5/Qwen3
format ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Same extraction as verl 0.9.1's ``HermesToolParser`` (written from its behaviour): the turn
holds calls only when both tags occur; each non-greedy ``<tool_call>(.*?)</tool_call>`` span
(across lines) is one call; the content is the text with those spans removed (not stripped);
the arguments are re-serialised with ``json.dumps(..., ensure_ascii=False)``. The caller
decodes the turn's token ids first (verl: ``tokenizer.decode``, special tokens kept).

Differences from verl, so that a bad call becomes an error turn instead of vanishing: a span
that is not JSON, not an object, lacks ``name`` (a string) or ``arguments`` (an object) is kept
as a :class:`ToolCall` with ``error`` set (verl logs and drops it, and a turn whose every call
is malformed ends the trajectory); an opening tag left unclosed after the last closed span (or
in a turn with no closing tag at all) is one malformed call too (verl: no call). Arguments given
as a JSON string holding an object are decoded (Qwen's templates write objects; some models
write strings).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

__all__ = ["FORMATS", "ParsedTurn", "ToolCall", "parse_hermes", "parse_tool_calls"]

START, END = "<tool_call>", "</tool_call>"
_SPAN = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote."""

    name: str
    """The tool's name ("" when the call is malformed beyond reading one)."""
    arguments: str
    """The arguments as JSON text of an object ("{}" when malformed)."""
    error: str | None = None
    """Why the call is malformed; None for a well-formed call."""
    raw: str = ""
    """The text between the tags as the model wrote it."""
    tool_call_id: str | None = None
    """The id the model gave the call, if any (hermes has none)."""


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn split into its content and its calls, in order."""

    content: str
    calls: list[ToolCall]


def _parse_span(raw: str) -> ToolCall:
    try:
        call = json.loads(raw)
    except json.JSONDecodeError as exc:
        return ToolCall("", "{}", f"not valid JSON ({exc.msg} at char {exc.pos})", raw)
    if not isinstance(call, dict):
        return ToolCall("", "{}", f"expected a JSON object, got {type(call).__name__}", raw)
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", "{}", 'missing "name" (a string)', raw)
    if "arguments" not in call:
        return ToolCall(name, "{}", 'missing "arguments"', raw)
    arguments = call["arguments"]
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError:
            decoded = None
        arguments = decoded if isinstance(decoded, dict) else arguments
    if not isinstance(arguments, dict):
        return ToolCall(name, "{}", '"arguments" must be a JSON object', raw)
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False), None, raw)


def parse_hermes(text: str) -> ParsedTurn:
    """``text``'s content and calls (see the module docstring)."""
    if START not in text:
        return ParsedTurn(text, [])
    if END not in text:
        head, _, tail = text.partition(START)
        return ParsedTurn(head, [ToolCall("", "{}", f"{START} without {END}", tail)])
    calls = [_parse_span(raw) for raw in _SPAN.findall(text)]
    content = _SPAN.sub("", text)
    last_close = text.rfind(END)
    unclosed = text.find(START, last_close)
    if unclosed != -1:
        calls.append(ToolCall("", "{}", f"{START} without {END}", text[unclosed + len(START) :]))
        content = _SPAN.sub("", text[:unclosed])
    return ParsedTurn(content, calls)


FORMATS = {"hermes": parse_hermes}
"""``multi_turn.format`` → parser."""


def parse_tool_calls(text: str, format: str = "hermes") -> ParsedTurn:
    """Parse ``text`` in the ``multi_turn.format`` ``format`` (ValueError naming the ones built)."""
    if format not in FORMATS:
        raise ValueError(
            f"actor_rollout_ref.rollout.multi_turn.format={format!r} is not built "
            f"(built: {', '.join(sorted(FORMATS))})"
        )
    return FORMATS[format](text)
