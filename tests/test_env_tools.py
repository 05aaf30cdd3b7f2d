"""Tool-call parsing and response formatting: model text in, ToolCall / ToolCallError out."""
import json
import random
import re

import pytest

from rstarjax.env import (
    ERROR,
    ExecResult,
    ToolCall,
    ToolCallError,
    classify_tool_error,
    format_tool_response,
    parse_tool_call,
    parse_tool_calls,
    wrap_tool_response,
)
from rstarjax.env.code_judge import official_turn_call
from rstarjax.protocol import closed_spans

NAME = "execute_python_code_with_standard_io"


def call_text(obj) -> str:
    return f"<reason>let me compute</reason><tool_call>{json.dumps(obj)}</tool_call>"


def test_well_formed_call_with_input():
    text = call_text({"name": NAME, "arguments": {"code": "print(input())", "input": "5\n"}})
    assert parse_tool_call(text) == ToolCall(code="print(input())", stdin="5\n", name=NAME)


def test_paper_example_format_with_raw_newlines_in_code():
    # Models emit literal newlines inside the JSON string (not valid strict JSON): accepted.
    text = '<tool_call>{"name": "%s", "arguments": {"code": "import sympy\n\nprint(1)", "input": ""}}</tool_call>' % NAME
    call = parse_tool_call(text)
    assert isinstance(call, ToolCall) and call.code == "import sympy\n\nprint(1)" and call.stdin == ""


def test_missing_input_defaults_to_empty_and_numbers_become_text():
    assert parse_tool_call(call_text({"name": NAME, "arguments": {"code": "x"}})).stdin == ""
    assert parse_tool_call(call_text({"name": NAME, "arguments": {"code": "x", "input": 7}})).stdin == "7"


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('<tool_call>{"name": "%s", "arguments": {"code": "print(1)"}</tool_call>' % NAME, "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "JSON object"),
        (call_text({"name": "rm_rf", "arguments": {"code": "1"}}), "Unknown tool"),
        (call_text({"arguments": {"code": "1"}}), "Unknown tool"),
        (call_text({"name": NAME}), "arguments"),
        (call_text({"name": NAME, "arguments": {"input": "1"}}), "code"),
        (call_text({"name": NAME, "arguments": {"code": 12}}), "code"),
        (call_text({"name": NAME, "arguments": {"code": "   "}}), "empty"),
        (call_text({"name": NAME, "arguments": {"code": "1", "input": [1]}}), "input"),
        ("<tool_call></tool_call>", "empty"),
        ('<tool_call>{"name": "%s", "arguments": {"code": "1"}}' % NAME, "not terminated"),
    ],
)
def test_malformed_calls_become_errors_never_exceptions(text, fragment):
    out = parse_tool_call(text)
    assert isinstance(out, ToolCallError), out
    assert fragment in out.message
    assert classify_tool_error(out) == "parse"
    shown = format_tool_response(out)
    assert shown.startswith("Tool call error:") and fragment in shown


def test_deeply_nested_json_is_an_error_not_a_crash():
    out = parse_tool_call("<tool_call>" + "[" * 100000 + "</tool_call>")
    assert isinstance(out, ToolCallError) and "not valid JSON" in out.message


def test_no_tool_call_is_none_and_non_text_is_none():
    assert parse_tool_call("<answer>\\boxed{3}</answer>") is None
    assert parse_tool_call(None) is None


def test_first_call_is_used_and_all_calls_listed():
    a = call_text({"name": NAME, "arguments": {"code": "1"}})
    b = call_text({"name": NAME, "arguments": {"code": "2"}})
    assert parse_tool_call(a + b).code == "1"
    assert [c.code for c in parse_tool_calls(a + b)] == ["1", "2"]


@pytest.mark.parametrize("open_tag,close_tag", [("<tool_call>", "</tool_call>"), ("<answer>", "</answer>"),
                                               ("<|im_start|>assistant", "<|im_end|>")])
def test_closed_spans_are_the_official_regexs_findall(open_tag, close_tag):
    """The official code reads blocks with re.findall(open.*?close, text, re.DOTALL); ours scans
    linearly and must give the same spans on any text, tags cut, doubled and nested included."""
    rng = random.Random(0)
    pieces = [open_tag, close_tag, open_tag[:4], close_tag[2:], open_tag + close_tag, close_tag + open_tag, "x", "\n"]
    pattern = re.compile(re.escape(open_tag) + "(.*?)" + re.escape(close_tag), re.DOTALL)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 24)))
        assert closed_spans(text, open_tag, close_tag) == pattern.findall(text), text


def test_a_degenerate_turn_of_open_tags_parses_to_its_first_complete_call():
    """A repetition loop of <tool_call> (one token) after a complete call: the first call is
    still the one run, by both layouts, and an unterminated run of open tags is one error."""
    good = call_text({"name": NAME, "arguments": {"code": "1"}})
    assert parse_tool_call(good + "<tool_call>" * 20000).code == "1"
    assert [c.code for c in parse_tool_calls(good + "<tool_call>" * 20000)] == ["1"]
    assert isinstance(parse_tool_call("<tool_call>" * 20000), ToolCallError)
    official = good.replace(NAME, "python_code_with_standard_io")
    assert "1" in official_turn_call(official + "<tool_call>" * 20000).code


def test_double_encoded_arguments_are_accepted():
    text = call_text({"name": NAME, "arguments": json.dumps({"code": "print(2)"})})
    assert parse_tool_call(text).code == "print(2)"


def test_format_truncates_in_the_middle_and_marks_it():
    text = "A" * 5000 + "MIDDLE" + "Z" * 5000
    shown = format_tool_response(ExecResult("stdout", text), max_chars=100)
    assert shown.startswith("A" * 50) and shown.endswith("Z" * 50)
    assert "MIDDLE" not in shown and "characters truncated" in shown
    assert str(len(text) - 100) in shown


def test_format_kinds_and_classification():
    assert format_tool_response(ExecResult("display", "")) == "(no output)"
    assert format_tool_response(ExecResult("display", "3")) == "3"
    assert classify_tool_error(ExecResult("stdout", "1")) is None
    assert classify_tool_error(ExecResult(ERROR, "boom")) == "execution"
    assert classify_tool_error(ExecResult("timeout", "t")) == "timeout"
    assert wrap_tool_response("3") == "<tool_response>3</tool_response>"
    with pytest.raises(ValueError):
        ExecResult("weird", "")
