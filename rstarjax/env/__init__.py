"""rstarjax.env: the isolated Python code environment, the tool-call layer and the verifier.

Imports nothing else from rstarjax but the import-free ``protocol`` (see docs/design.md and docs/code_env.md).
"""
from .executor import CodeExecutor, ExecutorClosedError, ExecutorConfig
from .results import DISPLAY, ERROR, RESULT_KINDS, STDOUT, TIMEOUT, ExecResult, VerifyResult
from .sandbox import SandboxLimits
from .tools import (
    EXECUTION,
    PARSE,
    TIMEOUT_ERROR,
    TOOL_NAME,
    ToolCall,
    ToolCallError,
    classify_tool_error,
    format_tool_response,
    has_tool_call,
    parse_tool_call,
    parse_tool_calls,
    wrap_tool_response,
)
from .verify import extract_final_answer, find_boxed, is_correct

__all__ = [
    "CodeExecutor", "ExecutorConfig", "ExecutorClosedError", "SandboxLimits",
    "ExecResult", "VerifyResult", "STDOUT", "DISPLAY", "ERROR", "TIMEOUT", "RESULT_KINDS",
    "ToolCall", "ToolCallError", "parse_tool_call", "parse_tool_calls", "has_tool_call",
    "format_tool_response", "wrap_tool_response", "classify_tool_error", "PARSE", "EXECUTION",
    "TIMEOUT_ERROR", "TOOL_NAME", "is_correct", "extract_final_answer", "find_boxed",
]
