"""The official rStar2-Agent tool environment, reproduced on our sandbox (chat format
``rstar2_official``, ``ChatFormat.tool_protocol == "code_judge"``).

The released model was trained with a Python tool that (microsoft/rStar ecbfb94)

1. parses a turn's calls with ``rstar2_agent/tools/tool_parser.py`` and answers them with
   ``RStar2AgentLoop._call_tool`` (``rstar2_agent/rollout/rstar2_agent_loop.py``) and ``PythonTool``
   (``rstar2_agent/tools/code_judge_tool.py``): strict JSON, ``arguments`` of any JSON type, a
   missing ``code`` run as empty code, and the errors of each step shown verbatim
   (``official_turn_call`` below);
2. sends the program wrapped by ``combine_code_template`` (``rstar2_agent/tools/code_judge_utils.py``):
   it runs the code REPL-style (the ``repr`` of a final bare expression is printed) and reports an
   exception as ``Type at line N: message`` plus the offending line on stderr, exit status 1,
   with that code's quirks (the line number of an error in the final expression is offset by the
   lines before it, so the offending line is usually not found; a failing final expression is run
   a second time as a statement);
3. runs it in code-judge (github 0xWJ/code-judge f809f35, started with ``MAX_EXECUTION_TIME=4`` as
   the rStar README does): a fresh ``python3`` whose stdout is a block-buffered pipe (so what a
   failing program printed is lost unless it was flushed: the wrapper ends it with ``os._exit(1)``),
   stderr line-buffered, a 4 s alarm that prints ``Suicide from timeout.`` and kills the process,
   each stream cut to its first 1000 characters, and ``reason: worker_timeout`` when a failed run
   took the whole limit;
4. writes the response as ``run_tool_calls_on_server_async`` does: ``Tool call success`` or
   ``Tool call failure`` + ``reason: ...``, then ``stdout: ...``, ``stderr: ...`` (each when not
   empty) and ``execution time: 0.00s``, joined by newlines; verl cuts a response longer than
   ``max_tool_response_length`` characters in the middle, marked ``...(truncated)...``.

Steps 2-3 happen INSIDE our sandbox, unchanged: ``wrap_program`` turns the model's code into a
program (our own prelude, not the official text) that implements the wrapper's semantics and
code-judge's streams and alarm in the sandboxed process, and prints one result line
(``RESULT_MARK`` + JSON: stdout and stderr as code-judge would return them, the exit status, the
time, whether code-judge could read them); ``judge_result`` turns the sandbox's answer into
code-judge's response text. The program's sys.stdout and sys.stderr are CPython's own
TextIOWrapper and BufferedWriter, built as python3 builds them for a pipe in UTF-8 mode (``.buffer``,
``fileno()``, ``encoding``, ``errors``, the points where text reaches the pipe), over a capture of
what the pipe receives; code-judge's reading of it is reproduced: stdout split on its closing
mark ``@@E`` (a second mark, or bytes that are not UTF-8 in either stream, is its
``internal_error``). What cannot be the same: the time (measured here, printed with two
decimals), output a program writes to the file descriptors directly (subprocesses, ``os.write``:
not captured) and the 256 MiB memory limit (the sandbox's own limits apply).
tests/test_code_judge.py compares all of it with the official code's own output
(tests/fixtures/rstar2_official/code_judge_responses.json).

Standard library only: the executor's router (``routing.py``, loaded by the zygote) imports this.
"""
from __future__ import annotations

import ast
import json

from rstarjax.protocol import OFFICIAL_TOOL_NAME, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, tool_call_bodies

from .results import DISPLAY, ERROR, STDOUT, TIMEOUT, ExecResult

TIME_LIMIT_S = 4  # code-judge MAX_EXECUTION_TIME as the rStar README starts its server and workers
# code-judge kills a program this long after its own limit: the sandbox's limit for a call is
# time_limit_s + this, which must itself be within the code pool's limit per call
# (rl.agent_loop.require_tool_timeout_fits checks it once, when the rollouts are set up)
SANDBOX_GRACE_S = 1.0
MAX_STREAM_CHARS = 1000  # code-judge MAX_STDOUT_ERROR_LENGTH: each stream is cut to its head
# the BufferedWriter python3 puts under stdout on a pipe (its size is the pipe's st_blksize on
# Linux); the TextIOWrapper above it holds text until 8192 bytes (its chunk size) or a flush
PIPE_BUFFER_BYTES = 4096
SCRIPT_ENDING_MARK = "@@E"  # code-judge's python_executor: its closing template prints it; stdout is split on it
TIMEOUT_LINE = "Suicide from timeout.\n"  # printed (flushed) by code-judge's alarm handler
WORKER_TIMEOUT = "worker_timeout"  # code-judge's reason for a failed run that took the whole limit
INTERNAL_ERROR = "internal_error"  # code-judge's reason when it cannot read a run's output
RESULT_MARK = "\x1e<rstarjax-code-judge-result>"  # starts the prelude's one result line on stdout
WRAPPER_MARK = "# rstarjax: code-judge wrapper (env/code_judge.py)\n"  # first line of a wrapped program
TOOLS = (OFFICIAL_TOOL_NAME,)  # python_tool_config.yaml: the one tool the official run registers
# the installed pydantic's docs version in FunctionCall's validation message (the fixture's; the
# released run's is not recorded anywhere)
PYDANTIC_DOCS_VERSION = "2.13"

# The program our sandbox runs: this prelude, then one line calling _cj_main with the model's code.
# Everything it defines is prefixed _cj_; the model's code runs in its own fresh namespace.
_PRELUDE = WRAPPER_MARK + r'''
import ast as _cj_ast
import codecs as _cj_codecs
import io as _cj_io
import json as _cj_json
import os as _cj_os
import signal as _cj_signal
import sys as _cj_sys
import time as _cj_time
import traceback as _cj_traceback


class _CjPipe(_cj_io.RawIOBase):
    """What code-judge's pipe receives from one stream: its first `keep` bytes, how many bytes
    came, how many SCRIPT_ENDING_MARKs (code-judge splits stdout on it) and whether they are
    valid UTF-8 (code-judge decodes them strictly). CPython's own TextIOWrapper and
    BufferedWriter sit above it, built as python3 builds them for a pipe, so what reaches it
    and when (a flush, 8192 bytes, a line of stderr) is the interpreter's doing."""

    def __init__(self, fd, keep):
        self.fd, self.keep = fd, keep
        self.head, self.received, self.marks, self.tail = bytearray(), 0, 0, b""
        self.decoder = _cj_codecs.getincrementaldecoder("utf-8")("strict")
        self.invalid = False

    def writable(self):
        return True

    def fileno(self):
        return self.fd

    def isatty(self):
        return False

    def write(self, data):
        data = bytes(data)
        if len(self.head) < self.keep:
            self.head += data[:self.keep - len(self.head)]
        self.received += len(data)
        window = self.tail + data  # a mark may straddle two writes
        self.marks += window.count(SCRIPT_ENDING_MARK)
        self.tail = window[-(len(SCRIPT_ENDING_MARK) - 1):]
        if not self.invalid:
            try:
                self.decoder.decode(data)
            except UnicodeDecodeError:
                self.invalid = True
        return len(data)

    def text(self):
        """The received text (its first `keep` bytes' worth), and whether code-judge could
        decode all of it."""
        ok = not self.invalid
        if ok:
            try:
                self.decoder.decode(b"", True)
            except UnicodeDecodeError:  # ends inside a character
                ok = False
        return self.head.decode("utf-8", "ignore"), ok


def _cj_stream(fd, errors, line_buffering):
    pipe = _CjPipe(fd, 4 * MAX_STREAM_CHARS)
    return pipe, _cj_io.TextIOWrapper(_cj_io.BufferedWriter(pipe, PIPE_BUFFER_BYTES), encoding="utf-8",
                                      errors=errors, line_buffering=line_buffering)


def _cj_flush(*streams):
    for stream in streams:
        try:
            stream.flush()
        except Exception:  # closed by the program, or replaced by something that cannot flush
            pass


def _cj_finish(status, started, everything_shown, script_ended=False):
    """The result line. `everything_shown`: the interpreter exits normally (it flushes the
    streams); `script_ended`: code-judge's closing template ran (its own mark ends stdout)."""
    if everything_shown:
        _cj_flush(_cj_sys.stdout, _cj_sys.stderr, _CJ_STDOUT, _CJ_STDERR)
    out, out_ok = _CJ_OUT_PIPE.text()
    err, err_ok = _CJ_ERR_PIPE.text()
    marks = _CJ_OUT_PIPE.marks + (1 if script_ended else 0)
    # code-judge: `stdout, meta = stdout.split(MARK, 2)` fails on two marks; one from the program
    # (a run that ended before the closing template) cuts stdout there; an undecodable stream fails
    internal_error = marks >= 2 or not (out_ok and err_ok)
    if marks == 1 and not script_ended:
        out = out.split(SCRIPT_ENDING_MARK.decode(), 1)[0]
    line = _cj_json.dumps({"stdout": out, "stderr": err, "status": status, "internal_error": internal_error,
                           "cost": _cj_time.perf_counter() - started})
    _CJ_REAL_STDOUT.write(RESULT_MARK + line + "\n")
    _CJ_REAL_STDOUT.flush()
    _cj_os._exit(0)


def _cj_located(exc, source, offset):
    """The official CodeExecutionError's message: 'Type at line N: message' and the line, when
    line N (the error's line plus `offset`) exists in `source`; else 'Type: message'."""
    if hasattr(exc, "lineno"):
        lineno = exc.lineno
    else:
        tb = exc.__traceback__
        if tb:
            while tb.tb_next:
                tb = tb.tb_next
            lineno = tb.tb_lineno
        else:
            lineno = -1
    if lineno is None:
        lineno = -1
    if lineno != -1:
        lineno += offset
        lines = source.splitlines()
        if 0 <= lineno - 1 < len(lines):
            return "%s at line %d: %s\n  %s" % (type(exc).__name__, lineno, exc, lines[lineno - 1])
    return "%s: %s" % (type(exc).__name__, exc)


class _CjFailed(Exception):
    pass


def _cj_split(code):
    """(body, final bare expression or None), cut at whole lines as the official wrapper does."""
    try:
        tree = _cj_ast.parse(code)
    except SyntaxError as exc:
        raise _CjFailed(_cj_located(exc, code, 0))
    if tree.body and isinstance(tree.body[-1], _cj_ast.Expr):
        last = tree.body[-1]
        end = last.end_lineno if getattr(last, "end_lineno", None) else last.lineno
        lines = code.splitlines()
        return "\n".join(lines[:last.lineno - 1]), "\n".join(lines[last.lineno - 1:end])
    return code, None


def _cj_redirected(run):
    """`run()` with the original streams as sys.stdout / sys.stderr, the ones before restored
    after (the official wrapper's redirect_stdout / redirect_stderr around each exec): a stream
    the program set there is dropped, and CPython closes what it wrapped."""
    saved = _cj_sys.stdout, _cj_sys.stderr
    _cj_sys.stdout, _cj_sys.stderr = _CJ_STDOUT, _CJ_STDERR
    try:
        return run()
    finally:
        _cj_sys.stdout, _cj_sys.stderr = saved


def _cj_execute(code, namespace):
    body, last = _cj_split(code)
    if body:
        try:
            _cj_redirected(lambda: exec(compile(body, "<string>", "exec"), namespace))
        except Exception as exc:
            raise _CjFailed(_cj_located(exc, body, 0))
    if last:
        try:
            value = _cj_redirected(lambda: eval(compile(last, "<string>", "eval"), namespace))
            if value is not None:
                print(repr(value), file=_cj_sys.stdout)
        except Exception:
            try:  # the official wrapper runs a failing final expression again, as a statement
                _cj_redirected(lambda: exec(compile(last, "<string>", "exec"), namespace))
            except Exception as exc:
                raise _CjFailed(_cj_located(exc, last, len(body.splitlines()) if body else 0))


def _cj_main(code, time_limit):
    global _CJ_OUT_PIPE, _CJ_ERR_PIPE, _CJ_STDOUT, _CJ_STDERR, _CJ_REAL_STDOUT
    started = _cj_time.perf_counter()
    _CJ_REAL_STDOUT = _cj_sys.__stdout__
    # python3's streams for a pipe, in the UTF-8 mode code-judge's workers run in
    _CJ_OUT_PIPE, _CJ_STDOUT = _cj_stream(1, "surrogateescape", False)
    _CJ_ERR_PIPE, _CJ_STDERR = _cj_stream(2, "backslashreplace", True)

    def timed_out(*_):  # code-judge's alarm: print flushed, then the process group is killed
        try:
            print(TIMEOUT_LINE, end="", file=_cj_sys.stdout, flush=True)
        except Exception:
            pass
        _cj_finish(-9, started, False)

    _cj_signal.signal(_cj_signal.SIGALRM, timed_out)
    _cj_signal.setitimer(_cj_signal.ITIMER_REAL, time_limit)
    _cj_sys.stdout, _cj_sys.stderr = _CJ_STDOUT, _CJ_STDERR
    _cj_sys.__stdout__, _cj_sys.__stderr__ = _CJ_STDOUT, _CJ_STDERR
    _cj_sys.argv = [_cj_os.path.join(_cj_os.getcwd(), "source.py")]  # code-judge runs the file it wrote
    namespace = {"__name__": "__main__", "__file__": "<string>", "__builtins__": __builtins__}
    try:
        _cj_execute(code, namespace)
    except _CjFailed as failed:
        try:
            print(failed.args[0], file=_cj_sys.stderr)
        except Exception:
            pass
        _cj_finish(1, started, False)  # the wrapper's os._exit(1): unflushed output is lost
    except SystemExit as exc:  # leaves the official wrapper: the interpreter exits with its code
        status = exc.code
        if status is None:
            status = 0
        elif not isinstance(status, int):
            try:
                print(status, file=_cj_sys.stderr)
            except Exception:
                pass
            status = 1
        _cj_finish(status, started, True)
    except BaseException as exc:  # not an Exception (KeyboardInterrupt, ...): Python's own report
        try:
            _cj_sys.stderr.write("".join(_cj_traceback.format_exception(type(exc), exc, exc.__traceback__)))
        except Exception:
            pass
        _cj_finish(1, started, True)
    _cj_finish(0, started, True, script_ended=True)
'''


def wrap_program(code: str, time_limit_s: float = TIME_LIMIT_S) -> str:
    """The program our sandbox runs for the model's ``code`` (see the module doc): the prelude,
    then ``_cj_main(<code>, <limit>)``. Its output ends with one ``RESULT_MARK`` line."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    constants = (f"MAX_STREAM_CHARS = {MAX_STREAM_CHARS}\nPIPE_BUFFER_BYTES = {PIPE_BUFFER_BYTES}\n"
                 f"TIMEOUT_LINE = {TIMEOUT_LINE!r}\nRESULT_MARK = {RESULT_MARK!r}\n"
                 f"SCRIPT_ENDING_MARK = {SCRIPT_ENDING_MARK.encode()!r}\n")
    return f"{_PRELUDE}\n{constants}_cj_main({code!r}, {float(time_limit_s)!r})\n"


def embedded_code(program: str) -> str | None:
    """The model's code inside a ``wrap_program`` program (None for any other program): the
    executor routes a call by the code the model wrote, not by the prelude's imports."""
    if not program.startswith(WRAPPER_MARK):
        return None
    last = program.rstrip("\n").rsplit("\n", 1)[-1]
    try:
        call = ast.parse(last, mode="eval").body
        return ast.literal_eval(call.args[0])
    except (SyntaxError, ValueError, AttributeError, IndexError):
        return None


# ---- the response ------------------------------------------------------------------------------
def response_text(success: bool, reason: str, stdout: str, stderr: str, cost_s: float) -> str:
    """``run_tool_calls_on_server_async``'s text for one code-judge result."""
    parts = ["Tool call success"] if success else ["Tool call failure", f"reason: {reason}"]
    if stdout:
        parts.append(f"stdout: {stdout}")
    if stderr:
        parts.append(f"stderr: {stderr}")
    parts.append(f"execution time: {cost_s:.2f}s")
    return "\n".join(parts)


def parse_result_line(text: str) -> dict | None:
    """The prelude's result (stdout, stderr, status, cost) from the sandbox's stdout, or None when
    the program never wrote it (the sandbox killed it, or the model's code ended the process)."""
    at = text.rfind(RESULT_MARK)
    if at < 0:
        return None
    try:
        result = json.loads(text[at + len(RESULT_MARK):].split("\n", 1)[0])
        if (isinstance(result, dict) and isinstance(result.get("stdout"), str) and isinstance(result.get("stderr"), str)
                and isinstance(result.get("status"), int) and isinstance(result.get("cost"), (int, float))):
            return result
    except ValueError:
        pass
    return None


def judge_result(result: ExecResult, time_limit_s: float = TIME_LIMIT_S) -> ExecResult:
    """The sandbox's answer to a ``wrap_program`` program as code-judge's: ``text`` is the official
    response (before verl's truncation), ``kind`` says how it went (stdout: success; timeout: a
    failure that took the whole limit, code-judge's ``worker_timeout``; error: any other failure),
    so error counts mean what they do for the paper's protocol. Infrastructure errors pass through."""
    if result.infra_error:
        return result
    found = parse_result_line(result.text) if result.kind in (STDOUT, DISPLAY) else None
    if found is None:  # no result line: the sandbox's own verdict, with no output code-judge would keep
        success = result.kind in (STDOUT, DISPLAY)
        reason = WORKER_TIMEOUT if result.kind == TIMEOUT else ""
        text = response_text(success, reason, "", "", result.duration_s)
    elif found.get("internal_error"):  # code-judge could not read the output: its worker's error, no streams
        success, reason = False, INTERNAL_ERROR
        text = response_text(False, INTERNAL_ERROR, "", "", 0.0)
    else:
        success = found["status"] == 0
        reason = WORKER_TIMEOUT if not success and found["cost"] >= time_limit_s else ""
        text = response_text(success, reason, found["stdout"][:MAX_STREAM_CHARS], found["stderr"][:MAX_STREAM_CHARS],
                             found["cost"])
    kind = STDOUT if success else (TIMEOUT if reason == WORKER_TIMEOUT else ERROR)
    return ExecResult(kind, text, duration_s=result.duration_s, timings=result.timings)


def truncate(text: str, max_chars: int, side: str = "middle") -> str:
    """verl's cut of a tool response longer than ``max_chars`` (``_call_tool``;
    ``tool_response_truncate_side``, "middle" by default)."""
    if not text or len(text) <= max_chars:
        return text
    if side == "left":
        return text[:max_chars] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-max_chars:]
    half = max_chars // 2
    return text[:half] + "...(truncated)..." + text[-half:]


# ---- which calls run ---------------------------------------------------------------------------
def official_turn_call(text: str, time_limit_s: float = TIME_LIMIT_S):
    """The call the official loop answers after a model turn: None when the turn does not hold
    both tags or no complete ``<tool_call>...</tool_call>`` block (the episode ends); else its
    first block (verl's ``max_parallel_calls=1``) as ``official_call`` reads it."""
    if TOOL_CALL_OPEN not in text or TOOL_CALL_CLOSE not in text:
        return None
    bodies = tool_call_bodies(text)  # the official re.findall's blocks, in linear time
    return official_call(bodies[0], time_limit_s) if bodies else None


def _pydantic_input_value(value) -> str:
    """pydantic-core's ``input_value=`` text: the repr, over 50 characters cut to its first 25
    and last 24 around "..."."""
    text = repr(value)
    return text[:25] + "..." + text[-24:] if len(text) > 50 else text


def _pydantic_string_error(value) -> str:
    return ("1 validation error for FunctionCall\nname\n  Input should be a valid string "
            f"[type=string_type, input_value={_pydantic_input_value(value)}, input_type={type(value).__name__}]\n"
            f"    For further information visit https://errors.pydantic.dev/{PYDANTIC_DOCS_VERSION}/v/string_type")


def sandbox_timeout_s(time_limit_s: float) -> float:
    """The sandbox's wall-clock limit for a program that stops itself at ``time_limit_s``."""
    return time_limit_s + SANDBOX_GRACE_S


def official_call(body: str, time_limit_s: float = TIME_LIMIT_S):
    """One call's body as the official code answers it: a ``ToolCall`` whose ``code`` is the
    wrapped program to run, or a ``ToolCallError`` whose message IS the tool response (shown
    verbatim, never truncated, as the official loop returns these texts before cutting):

    - the parser (``RStar2AgentHermesToolParser``): strict ``json.loads`` (a raw newline or tab
      inside a string fails), ``obj["name"]`` and ``obj["arguments"]`` (any JSON type), a string
      name -> "Failed to decode tool call: <the exception>";
    - ``_call_tool`` and ``PythonTool.execute``: an unknown tool, ``arguments`` that are not an
      object (a JSON-encoded string included), ``code`` that is not a string (``.encode`` in
      ``generate_tool_call_code``) -> "Error when executing tool: <the exception>"; an ``input``
      that is neither a string nor null is refused by code-judge's request model (HTTP 422), and
      after 4 attempts the whole batch fails -> the batch's error (here a batch of one);
    - otherwise the call runs: a missing ``code`` as empty code, a missing or null ``input`` as
      no input. The program's own alarm ends it after ``time_limit_s``; the sandbox's kill comes
      1 s later (code-judge's process timeout is its limit + 1 s)."""
    from .tools import ToolCall, ToolCallError  # (tools imports this module)

    try:
        obj = json.loads(body)
        name, arguments = obj["name"], obj["arguments"]
        arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(name, str):
            raise ValueError(_pydantic_string_error(name))
    except Exception as exc:  # noqa: BLE001 - the official parser's catch-all
        return ToolCallError(f"Failed to decode tool call: {exc}")
    params = json.loads(arguments)
    if name not in TOOLS:
        return ToolCallError(f"Error when executing tool: {KeyError(name)}")
    if not isinstance(params, dict):
        return ToolCallError(f"Error when executing tool: '{type(params).__name__}' object has no attribute 'get'")
    code, stdin = params.get("code", ""), params.get("input", "")
    if not isinstance(code, str):
        return ToolCallError(f"Error when executing tool: '{type(code).__name__}' object has no attribute 'encode'")
    try:
        code.encode()  # generate_tool_call_code's base64 of the code: a lone surrogate cannot be encoded
    except UnicodeEncodeError as exc:
        return ToolCallError(f"Error when executing tool: {exc}")
    if stdin is not None and not isinstance(stdin, str):
        return ToolCallError("Error when executing tool: run_tool_calls_on_server_async failed for 1 tool calls "
                             "after 4 attempts.")
    return ToolCall(code=wrap_program(code, time_limit_s), stdin=stdin or "", name=name,
                    sandbox_timeout_s=sandbox_timeout_s(time_limit_s))
