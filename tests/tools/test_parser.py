"""Hermes tool-call parsing: verl's extraction, and malformed calls kept as errors."""

from __future__ import annotations

import json

import pytest

from megarl.tools.parser import ToolCall, parse_tool_calls


def test_several_calls_and_the_content_around_them():
    text = (
        "I will search twice.\n"
        '<tool_call>\n{"name": "search", "arguments": {"query_list": ["élan"]}}\n</tool_call>\n'
        'then <tool_call>{"name": "calculator", "arguments": {"expression": "2**100"}}</tool_call>'
        " done"
    )
    turn = parse_tool_calls(text)
    assert turn.content == "I will search twice.\n\nthen  done"
    assert [(c.name, json.loads(c.arguments), c.error) for c in turn.calls] == [
        ("search", {"query_list": ["élan"]}, None),
        ("calculator", {"expression": "2**100"}, None),
    ]
    assert "élan" in turn.calls[0].arguments  # ensure_ascii=False, as verl


def test_no_call_leaves_the_text_as_content():
    assert parse_tool_calls("The answer is 4.").calls == []
    assert parse_tool_calls("The answer is 4.").content == "The answer is 4."
    # verl: calls only when both tags occur; a closing tag alone is content
    assert parse_tool_calls("x </tool_call>").calls == []


@pytest.mark.parametrize(
    ("inner", "error"),
    [
        ('{"name": "f", "arguments": {"a": 1}', "not valid JSON"),
        ('["f", {}]', "expected a JSON object, got list"),
        ('{"arguments": {}}', 'missing "name"'),
        ('{"name": "f"}', 'missing "arguments"'),
        ('{"name": "f", "arguments": [1, 2]}', '"arguments" must be a JSON object'),
    ],
)
def test_a_malformed_call_is_kept_with_its_error(inner, error):
    turn = parse_tool_calls(f"a<tool_call>{inner}</tool_call>b")
    (call,) = turn.calls
    assert call.error is not None and call.error.startswith(error) and call.raw == inner
    assert turn.content == "ab"


def test_malformed_and_good_calls_keep_their_order():
    turn = parse_tool_calls(
        '<tool_call>oops</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    )
    assert [(c.name, c.error is None) for c in turn.calls] == [("", False), ("g", True)]


def test_arguments_as_a_json_string_are_decoded():
    (call,) = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    ).calls
    assert call == ToolCall("f", '{"x": 1}', None, call.raw)


def test_an_unclosed_call_is_malformed():
    turn = parse_tool_calls('Sure. <tool_call>{"name": "f", "arguments": {}}')
    assert turn.content == "Sure. " and turn.calls[0].error == "<tool_call> without </tool_call>"
    turn = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": {}}</tool_call> and <tool_call>{"name": "g"'
    )
    assert [c.error is None for c in turn.calls] == [True, False] and turn.content == " and "


def test_an_unknown_format_is_refused():
    with pytest.raises(
        ValueError, match=r"multi_turn.format='llama3_json' is not built \(built: hermes\)"
    ):
        parse_tool_calls("x", "llama3_json")
