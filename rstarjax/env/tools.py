"""Tool-call parsing and tool-response formatting (rStar2-Agent §2.1, Fig. 3).

The model calls the tool as
    <tool_call>{"name": "execute_python_code_with_standard_io",
                "arguments": {"code": "...", "input": "..."}}</tool_call>
Anything wrong with a call becomes a ToolCallError whose message is shown to the model inside
<tool_response> and counted as a parse error; nothing here raises on model text.
"""
from __future__ import annotations

import dataclasses
import json

# The protocol (tool name, tags) is defined once, in a module that imports nothing.
from rstarjax.protocol import (TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOL_NAME, TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN,
                               tool_call_bodies)

from . import code_judge
from .results import DISPLAY, ERROR, STDOUT, TIMEOUT, ExecResult

DEFAULT_MAX_CHARS = 4096


@dataclasses.dataclass(frozen=True)
class ToolCall:
    code: str  # the program the sandbox runs
    stdin: str = ""
    name: str = TOOL_NAME
    # the sandbox's wall-clock limit for this call; None: the rollout's tool_timeout_s (the
    # code-judge protocol's program stops itself at that limit and the sandbox kills 1 s later)
    sandbox_timeout_s: float | None = None


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    message: str


# Error classes the rollout counts (rl.trajectory.ToolErrorCounts fields).
PARSE, EXECUTION, TIMEOUT_ERROR = "parse", "execution", "timeout"


def classify_tool_error(outcome) -> str | None:
    """'parse' | 'execution' | 'timeout' for a failed tool call, None for a successful one."""
    if isinstance(outcome, ToolCallError):
        return PARSE
    if isinstance(outcome, ExecResult):
        if outcome.kind == ERROR:
            return EXECUTION
        if outcome.kind == TIMEOUT:
            return TIMEOUT_ERROR
        return None
    raise TypeError(f"expected ToolCallError or ExecResult, got {type(outcome).__name__}")


def has_tool_call(text: str) -> bool:
    return TOOL_CALL_OPEN in text


def parse_tool_call(text: str, tool_names: tuple[str, ...] = (TOOL_NAME,)) -> ToolCall | ToolCallError | None:
    """The first tool call in `text`. None when the text contains no <tool_call> at all (the
    rollout ends that turn without a call); ToolCallError for any malformed call. Never raises."""
    if not isinstance(text, str) or TOOL_CALL_OPEN not in text:
        return None
    bodies = tool_call_bodies(text)
    if not bodies:
        return ToolCallError(f"Tool call is not terminated: expected {TOOL_CALL_CLOSE} after {TOOL_CALL_OPEN}.")
    return parse_tool_call_body(bodies[0], tool_names)


def parse_tool_calls(text: str, tool_names: tuple[str, ...] = (TOOL_NAME,)) -> list[ToolCall | ToolCallError]:
    """Every complete <tool_call> block in `text`, in order."""
    if not isinstance(text, str):
        return []
    return [parse_tool_call_body(body, tool_names) for body in tool_call_bodies(text)]


def parse_tool_call_body(body: str, tool_names: tuple[str, ...] = (TOOL_NAME,)) -> ToolCall | ToolCallError:
    """One call's body (the text between the tags). Never raises: whatever the model wrote
    (nesting deeper than the parser's recursion limit included) becomes a ToolCallError."""
    try:
        return _parse_body(body, tool_names)
    except Exception as exc:  # noqa: BLE001 - the contract: model text never raises
        return ToolCallError(f"Tool call could not be parsed ({type(exc).__name__}).")


def _describe(value) -> str:
    """A short description of a JSON value for an error message (never recursive)."""
    return repr(value[:100]) if isinstance(value, str) else type(value).__name__


def _parse_body(body: str, tool_names: tuple[str, ...]) -> ToolCall | ToolCallError:
    body = body.strip()
    if not body:
        return ToolCallError("Tool call is empty: expected a JSON object with \"name\" and \"arguments\".")
    try:
        # strict=False: models write raw newlines inside JSON strings; that much we forgive.
        obj = json.loads(body, strict=False)
    except (ValueError, RecursionError) as exc:
        return ToolCallError(f"Tool call is not valid JSON: {str(exc)[:200]}")
    if not isinstance(obj, dict):
        return ToolCallError(f"Tool call must be a JSON object, got {type(obj).__name__}.")
    name = obj.get("name")
    if name not in tool_names:
        known = ", ".join(tool_names)
        return ToolCallError(f"Unknown tool {_describe(name)}; available tools: {known}.")
    args = obj.get("arguments")
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args, strict=False)
        except (ValueError, RecursionError):
            return ToolCallError("Tool call \"arguments\" is a string that is not a JSON object.")
    if not isinstance(args, dict):
        return ToolCallError("Tool call needs an \"arguments\" object with a \"code\" string.")
    code = args.get("code")
    if not isinstance(code, str):
        return ToolCallError("Tool call arguments need a \"code\" string.")
    if not code.strip():
        return ToolCallError("Tool call \"code\" is empty.")
    stdin = args.get("input", "")
    if stdin is None:
        stdin = ""
    if not isinstance(stdin, str):
        if isinstance(stdin, (int, float)) and not isinstance(stdin, bool):
            stdin = str(stdin)
        else:
            return ToolCallError("Tool call \"input\" must be a string.")
    return ToolCall(code=code, stdin=stdin, name=name)


def truncate_middle(text: str, max_chars: int) -> str:
    """Keep the head and tail, mark what was cut (at most `max_chars` plus the marker)."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    head = max_chars // 2
    tail = max_chars - head
    return f"{text[:head]}\n... [{len(text) - max_chars} characters truncated] ...\n{text[len(text) - tail:]}"


NO_OUTPUT = "(no output)"

# ChatFormat.tool_protocol: what runs for a call and what the model reads back. "paper": the model's
# code as it is, the responses below; "code_judge": the official rStar2-Agent environment
# (env/code_judge.py: its wrapper's semantics, code-judge's response text, verl's truncation).
PAPER, CODE_JUDGE = "paper", "code_judge"
TOOL_PROTOCOLS = (PAPER, CODE_JUDGE)


def tool_result(result: ExecResult, protocol: str = PAPER) -> ExecResult:
    """The sandbox's result as the protocol reports it (code_judge: ``code_judge.judge_result``)."""
    return code_judge.judge_result(result) if protocol == CODE_JUDGE else result


def format_tool_response(outcome, max_chars: int = DEFAULT_MAX_CHARS, protocol: str = PAPER) -> str:
    """The text that goes inside <tool_response>...</tool_response> for a result or a parse error.
    protocol="code_judge": a ToolCallError's message verbatim (the official loop's own texts, never
    cut) and a ``tool_result`` text cut as verl cuts it (``code_judge.truncate``)."""
    if protocol == CODE_JUDGE:
        if isinstance(outcome, ToolCallError):
            return outcome.message
        if isinstance(outcome, ExecResult):
            return code_judge.truncate(outcome.text, max_chars)
        raise TypeError(f"expected ToolCallError or ExecResult, got {type(outcome).__name__}")
    if isinstance(outcome, ToolCallError):
        text = f"Tool call error: {outcome.message}"
    elif isinstance(outcome, ExecResult):
        if outcome.kind in (STDOUT, DISPLAY):
            text = outcome.text if outcome.text.strip() else NO_OUTPUT
        elif outcome.kind == ERROR:
            text = outcome.text or "Error"
        else:
            text = outcome.text or "TimeoutError: execution timed out"
    else:
        raise TypeError(f"expected ToolCallError or ExecResult, got {type(outcome).__name__}")
    return truncate_middle(text, max_chars)


def wrap_tool_response(inner: str) -> str:
    return f"{TOOL_RESPONSE_OPEN}{inner}{TOOL_RESPONSE_CLOSE}"
