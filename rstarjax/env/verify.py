"""Answer extraction and checking (rStar2-Agent §2.2: reward 1 iff the boxed answer in <answer>
matches the ground truth under math-verify, else 0).

`is_correct` is the pure check with no time limit of its own: the sandbox runs it inside a pool
process under the pool's wall-clock kill (`CodeExecutor.submit_verify` / `CodeExecutor.verify`,
the one bounded path). math-verify's own timeouts are disabled on purpose: they use
`signal.alarm`, which raises (and is swallowed, giving reward 0) off the main thread.

Only the standard library (and the import-free `rstarjax.protocol`) is imported at module level:
the zygote loads this module; math-verify is imported on first use.
"""
from __future__ import annotations

import re

from rstarjax.protocol import ANSWER_CLOSE, ANSWER_OPEN, join_space_groups

_ANSWER_BLOCK = re.compile(f"{re.escape(ANSWER_OPEN)}(.*?)(?:{re.escape(ANSWER_CLOSE)}|$)", re.DOTALL)
_BOX_OPENERS = ("\\boxed", "\\fbox")
# "1000", "-17", "+3", "1,000,000" (thousands separators only in the canonical 3-digit groups).
# ASCII digits only: Python's \d is any Unicode digit ("١٢", "１２"), which math-verify does not read.
_INTEGER = re.compile(r"[+-]?(?:\d+|\d{1,3}(?:,\d{3})+)", re.ASCII)
# "32, 349" is a list of two numbers, never 32349: a comma followed by white space separates items
# (math-verify's own test cases read it so); only a bare comma can group thousands.
_COMMA_THEN_SPACE = re.compile(r",\s")
# "1 2" (a hedge, two numbers) is no integer: never joined into 12. math-verify reads such digits
# as a sum or a product ("3 4" -> 7, "7 0" -> 0), so an answer written so is never credited
# against an integer gold (``_integer_verdict``).
_DIGITS_SPLIT_BY_SPACE = re.compile(r"\d\s+\d", re.ASCII)
_STRIP_WRAPPERS = re.compile(r"^\\(?:text|textbf|mathrm|mathbf)\{(.*)\}$", re.DOTALL)
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
    """The final answer: the last \\boxed{} inside the last <answer> block (paper §2.2: "we
    extract the final answer from \\boxed{} within the <answer> tag"). None when there is no box
    there, or no <answer> block; ``outside_answer_block``: then the last \\boxed{} of the whole
    response (``reward.mode=boxed``, for a policy that writes no <answer> tags)."""
    blocks = _ANSWER_BLOCK.findall(response_text)
    if not blocks and not outside_answer_block:
        return None
    scope = blocks[-1] if blocks else response_text
    boxes = find_boxed(scope)
    if not boxes:
        return None
    return boxes[-1].strip()


def normalize_integer(text: str) -> int | None:
    """The integer written by `text` ("1,000", "1\\,000", "$-3$", "\\text{42}", "7."), or None."""
    s = text.strip().strip("$").strip()
    m = _STRIP_WRAPPERS.match(s)
    if m:
        s = m.group(1).strip()
    s = join_space_groups(s.replace("\\!", "").replace("{,}", ","))
    if _COMMA_THEN_SPACE.search(s) or _DIGITS_SPLIT_BY_SPACE.search(s):  # checked before the spaces go
        return None
    s = s.replace(" ", "")
    if s.endswith("."):
        s = s[:-1]
    if _INTEGER.fullmatch(s):
        return int(s.replace(",", ""))
    return None


def _integer_verdict(answer: str | None, gold_text: str) -> bool | None:
    """The verdict when no sympy is needed (no answer, or both sides plain integers), else None."""
    if answer is None or not answer or len(answer) > MAX_ANSWER_CHARS:
        return False
    gold_int = normalize_integer(gold_text)
    pred_int = normalize_integer(answer)
    if gold_int is not None and pred_int is not None:
        return gold_int == pred_int
    if gold_int is not None and _DIGITS_SPLIT_BY_SPACE.search(join_space_groups(answer)):
        return False  # "3 4" is no integer, though math-verify reads 7
    return None


def is_correct(response_text: str, gold, outside_answer_block: bool = False) -> bool:
    """rStar2-Agent eq. 3: reward 1 iff the final boxed answer (``extract_final_answer``) equals
    `gold`. No time limit: call it only under a wall-clock kill (the sandbox does:
    `CodeExecutor.verify`).

    Integer fast path (the paper trains on integer answers): when both sides are plain integers
    they are compared exactly without sympy. Otherwise math-verify decides (equivalent forms such
    as \\frac{1}{2} vs 0.5).
    """
    gold_text = str(gold).strip()
    answer = extract_final_answer(response_text, outside_answer_block)
    verdict = _integer_verdict(answer, gold_text)
    return verdict if verdict is not None else _math_verify(answer, gold_text)


def _math_verify(answer: str, gold_text: str) -> bool:
    # Imported here: sympy-heavy, and this module is loaded where it must not be (the lean zygote).
    from math_verify import grader, parse, parser, verify

    # We disable math-verify's alarm-based timeouts on purpose (see module docstring); the
    # wall-clock kill is the pool's job. Silence its once-per-process warning about it.
    parser.TIMEOUT_WARNING_SHOWN = grader.TIMEOUT_WARNING_SHOWN = True
    gold_parsed = parse("\\boxed{" + gold_text + "}", parsing_timeout=None)
    pred_parsed = parse("\\boxed{" + answer + "}", parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


# One comparison of each kind a gold answer takes (a number, an expression, an interval, a set, a
# matrix, a trigonometric value): sympy imports what each needs on its first use (units,
# combinatorics, set expressions: 35 modules, 0.2 s for an expression), which every forked
# verification would otherwise pay again.
WARM_UP_PAIRS = (("\\frac{1}{2}", "0.5"), ("x^2+2x+1", "(x+1)^2"), ("(1,2]", "(1,2]"), ("\\{1,2\\}", "\\{2,1\\}"),
                 ("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}"),
                 ("\\sin(\\pi/6)", "1/2"), ("5\\text{ cm}", "5"))


def warm_up() -> None:
    """Import math-verify and exercise each kind of comparison once (called by the zygote before
    forking: ``WARM_UP_PAIRS``)."""
    for answer, gold in WARM_UP_PAIRS:
        _math_verify(answer, gold)
