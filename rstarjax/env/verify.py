"""Answer extraction and checking (rStar2-Agent §2.2: reward 1 iff the boxed answer in <answer>
matches the ground truth under math-verify, else 0).

`is_correct` is the pure check. Its outer bound is the pool's wall-clock kill: the sandbox runs it
inside a pool process (`CodeExecutor.submit_verify` / `CodeExecutor.verify`, the one bounded
path). Inside, math-verify's own time limits (``MATH_VERIFY_TIMEOUT_S``, a parse or a comparison
past it is "not equal") apply where they work: they use `signal.alarm`, which only the main
thread may set; off it the alarm raises and math-verify swallows the error as reward 0 (the
verl/TRL "every reward is 0" bug), so there they are off and the pool's kill alone bounds a call.
The sandbox's verifier runs on its process's main thread.

Only the standard library (and the import-free `rstarjax.protocol`) is imported at module level:
the zygote loads this module; math-verify is imported on first use.
"""
from __future__ import annotations

import re
import signal
import sys
import threading

from rstarjax.protocol import ANSWER_CLOSE, ANSWER_OPEN, join_space_groups

_ANSWER_BLOCK = re.compile(f"{re.escape(ANSWER_OPEN)}(.*?)(?:{re.escape(ANSWER_CLOSE)}|$)", re.DOTALL)
_BOX_OPENERS = ("\\boxed", "\\fbox")
# "1000", "-17", "+3", "1,000,000" (thousands separators only in the canonical 3-digit groups),
# and a whole number written with a decimal point ("7.", "12.0", "1,000.00").
# ASCII digits only: Python's \d is any Unicode digit ("١٢", "１２"), which math-verify does not read.
_INTEGER = re.compile(r"([+-]?)(\d+|\d{1,3}(?:,\d{3})+)(?:\.0*)?", re.ASCII)
# "32, 349" is a list of two numbers, never 32349: a comma followed by white space separates items
# (math-verify's own test cases read it so); only a bare comma can group thousands.
_COMMA_THEN_SPACE = re.compile(r",\s")
# "1 2" (a hedge, two numbers) is no integer: never joined into 12. math-verify reads such digits
# as a sum or a product ("3 4" -> 7, "7 0" -> 0), so an answer written so is never credited
# against an integer gold (``_integer_verdict``).
_DIGITS_SPLIT_BY_SPACE = re.compile(r"\d\s+\d", re.ASCII)
# One wrapper around the whole text: a box (a gold written "\boxed{42}") or a text style.
_WRAPPER = re.compile(r"^\\(?:boxed|text|textbf|mathrm|mathbf)\s*\{(.*)\}$", re.DOTALL)
# U+2212, the minus sign of typeset text ("−5"); math-verify reads it as "-".
_UNICODE_MINUS = "\u2212"
MAX_ANSWER_CHARS = 1000  # longer "answers" are not answers; they also feed sympy pathologies


def find_boxed(text: str) -> list[str]:
    """Contents of every \\boxed{...} / \\fbox{...} (balanced braces), in order of appearance."""
    out = []
    i = 0
    while True:
        starts = [(text.find(op, i), op) for op in _BOX_OPENERS]
        starts = [(s, op) for s, op in starts if s >= 0]
        if not starts:
            return out
        start, op = min(starts)
        j = start + len(op)
        while j < len(text) and text[j] == " ":
            j += 1
        if j >= len(text) or text[j] != "{":
            i = j
            continue
        depth, k = 0, j
        while k < len(text):
            if text[k] == "{":
                depth += 1
            elif text[k] == "}":
                depth -= 1
                if depth == 0:
                    break
            k += 1
        if depth != 0:  # unbalanced: not a complete box
            return out
        out.append(text[j + 1 : k])
        i = k + 1


def extract_final_answer(response_text: str, outside_answer_block: bool = False) -> str | None:
    """The final answer: the last \\boxed{} inside the last <answer> block that holds a complete
    one (paper §2.2: "we extract the final answer from \\boxed{} within the <answer> tag"). None
    when no <answer> block holds one, or there is none; ``outside_answer_block``: then, with no
    <answer> block at all, the last \\boxed{} of the whole response (``reward.mode=boxed``, for a
    policy that writes no <answer> tags).

    Why not simply the last block: a block after the answer that holds no box is no answer of its
    own. Words after the answer that name the tag ("I wrapped it in an <answer> tag"), or a
    dangling "<answer>" at the end (an unclosed block runs to the end of the text), would
    otherwise hide the boxed answer before them."""
    blocks = _ANSWER_BLOCK.findall(response_text)
    if not blocks and not outside_answer_block:
        return None
    for scope in reversed(blocks) if blocks else [response_text]:
        boxes = find_boxed(scope)
        if boxes:
            return boxes[-1].strip()
    return None


def _unwrapped(text: str) -> str:
    """``text`` without the dollars, boxes and text styles around the whole of it:
    "$\\boxed{\\text{42}}$" -> "42"."""
    s = text.strip().strip("$").strip()
    while (m := _WRAPPER.match(s)) is not None:
        s = m.group(1).strip().strip("$").strip()
    return s


def integer_text(text: str) -> str | None:
    """The integer ``text`` writes, as canonical decimal digits ("1,000", "1\\,000", "1 000",
    "$-3$", "\\text{42}", "\\boxed{1{,}000}", "7.", "12.0", "−5", "042"), or None when it writes
    anything else. The one reading of an integer answer: the reward's (``_integer_verdict``) and the
    data filter's (``rstarjax.io.data.integer_answer``). Digits, not an int: Python's int()
    refuses a string of over ``sys.get_int_max_str_digits()`` (4,300) digits."""
    s = _unwrapped(text)
    s = join_space_groups(s.replace("\\!", "").replace("{,}", ",").replace(_UNICODE_MINUS, "-"))
    if _COMMA_THEN_SPACE.search(s) or _DIGITS_SPLIT_BY_SPACE.search(s):  # checked before the spaces go
        return None
    m = _INTEGER.fullmatch(s.replace(" ", ""))
    if m is None:
        return None
    sign, digits = m.group(1), m.group(2).replace(",", "").lstrip("0") or "0"
    return "-" + digits if sign == "-" and digits != "0" else digits


def _past_int_limit(digits: str) -> bool:
    """Whether int() refuses ``digits`` (Python's int-string limit; none before 3.11)."""
    limit = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 0
    return bool(limit) and len(digits.lstrip("-")) > limit


def normalize_integer(text: str) -> int | None:
    """The integer written by ``text`` (``integer_text``), or None; None too past Python's
    int-string limit, which int() refuses."""
    digits = integer_text(text)
    if digits is None or _past_int_limit(digits):
        return None
    return int(digits)


def _integer_verdict(answer: str | None, gold_text: str) -> bool | None:
    """The verdict when no sympy is needed (no answer, or both sides plain integers), else None."""
    if answer is None or not answer or len(answer) > MAX_ANSWER_CHARS:
        return False
    # compared as canonical digits, not ints: a gold of any length is compared (int() refuses one
    # past Python's int-string limit)
    gold_digits = integer_text(gold_text)
    answer_digits = integer_text(answer)
    if gold_digits is not None and answer_digits is not None:
        return gold_digits == answer_digits
    if gold_digits is not None and _DIGITS_SPLIT_BY_SPACE.search(join_space_groups(answer)):
        return False  # "3 4" is no integer, though math-verify reads 7
    return None


def is_correct(response_text: str, gold, outside_answer_block: bool = False) -> bool:
    """rStar2-Agent eq. 3: reward 1 iff the final boxed answer (``extract_final_answer``) equals
    `gold`. Bounded by math-verify's own time limits on the main thread only (module
    docstring): call it under a wall-clock kill (the sandbox does: `CodeExecutor.verify`).

    Integer fast path (the paper trains on integer answers): when both sides are plain integers
    they are compared exactly without sympy. Otherwise math-verify decides (equivalent forms such
    as \\frac{1}{2} vs 0.5).
    """
    gold_text = str(gold).strip()
    answer = extract_final_answer(response_text, outside_answer_block)
    verdict = _integer_verdict(answer, gold_text)
    return verdict if verdict is not None else _math_verify(answer, gold_text)


# math-verify's own default for a parse and for a comparison, each (on the main thread only:
# ``math_verify_timeout_s``); the pool's kill (reward.time_limit_s, 30 s) stays the outer bound.
MATH_VERIFY_TIMEOUT_S = 5


def math_verify_timeout_s() -> int | None:
    """``MATH_VERIFY_TIMEOUT_S`` where math-verify's alarm works (the main thread, with SIGALRM:
    the sandbox's verifier), else None: off the main thread the alarm raises and math-verify
    would score every answer 0 (module docstring)."""
    on_main_thread = threading.current_thread() is threading.main_thread()
    return MATH_VERIFY_TIMEOUT_S if on_main_thread and hasattr(signal, "SIGALRM") else None


_DEFAULT_LIMIT = object()


def _math_verify(answer: str, gold_text: str, timeout_s=_DEFAULT_LIMIT) -> bool:
    """math-verify's verdict, under ``timeout_s`` per parse and comparison (default
    ``math_verify_timeout_s()``; None: no limit)."""
    # Imported here: sympy-heavy, and this module is loaded where it must not be (the lean zygote).
    from math_verify import grader, parse, parser, verify

    if timeout_s is _DEFAULT_LIMIT:
        timeout_s = math_verify_timeout_s()
    # Silence math-verify's once-per-process warning that its timeouts are off (off the main thread).
    parser.TIMEOUT_WARNING_SHOWN = grader.TIMEOUT_WARNING_SHOWN = True
    gold_parsed = parse("\\boxed{" + gold_text + "}", parsing_timeout=timeout_s)
    pred_parsed = parse("\\boxed{" + answer + "}", parsing_timeout=timeout_s)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))


# One comparison of each kind a gold answer takes (a number, an expression, an interval, a set, a
# matrix, a trigonometric value), each pair equal: sympy imports what each needs on its first use
# (units, combinatorics, set expressions: 35 modules, 0.2 s for an expression), which every forked
# verification would otherwise pay again.
WARM_UP_PAIRS = (("\\frac{1}{2}", "0.5"), ("x^2+2x+1", "(x+1)^2"), ("(1,2]", "(1,2]"), ("\\{1,2\\}", "\\{2,1\\}"),
                 ("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}"),
                 ("\\sin(\\pi/6)", "1/2"), ("5\\text{ cm}", "5"))


def warm_up() -> None:
    """Import math-verify and exercise each kind of comparison once (called by the zygote before
    forking: ``WARM_UP_PAIRS``), checking each verdict.

    Every pair is equal, so a pair judged unequal means math-verify cannot read LaTeX here (a
    broken install, e.g. an antlr4 runtime that latex2sympy2_extended does not support: math-verify
    logs the parse error and returns nothing). Then every non-integer answer would score 0, blamed
    on the model; instead the verifier pool refuses to start (RuntimeError, naming the pair).
    Without a time limit: a first comparison slowed by a busy machine (math-verify reads a
    timeout as "unequal") must not pass for a broken install."""
    for answer, gold in WARM_UP_PAIRS:
        if not _math_verify(answer, gold, timeout_s=None):
            raise RuntimeError(
                f"the verifier's self-check failed: math-verify judges {answer!r} unequal to {gold!r}, "
                "which are equal. Its LaTeX parsing is broken in this Python environment (check that "
                "math-verify, latex2sympy2_extended and antlr4-python3-runtime are versions that work "
                "together); every non-integer answer would score 0")
