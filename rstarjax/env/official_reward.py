"""The official rStar2-Agent reward (``reward.mode=official``), reimplemented: repository
microsoft/rStar at ecbfb94, ``fused_compute_score/__init__.py`` ``compute_score``, the scorer that
the reward manager (``rstar2_agent/reward/server.py``) imports in the program it sends to
code-judge, run on the WHOLE decoded response (model turns and tool outputs, special tokens
dropped). (``rstar2_agent/reward/compute_score.py`` has the same function over verl's copies of
the graders, but nothing imports it.) It scores with

1. the PRIME grader (``fused_compute_score/prime_math``, verl's ``verl/utils/reward_score/prime_math``
   with its own ``timeout_limit``: ``compute_score``, which pulls an answer out of the text with
   ``match_answer`` and compares it with ``grade_answer`` (PRM800K's normalisation + sympy) and
   then ``math_equal`` (numeric; its symbolic branch is dead as shipped, see ``_symbolic_equal``),
   and when that fails
2. math-verify (``fused_compute_score/math_verify.py``, verl's ``verl/utils/reward_score/math_verify.py``:
   the gold as ``\\boxed{gold}``, the prediction extracted from the whole text as an expression or
   LaTeX).

Reward 1.0 if either says correct, else 0.0; an exception in a grader counts as "not correct".
Unlike the paper's reward (``verify.is_correct``: the last ``\\boxed{}`` inside the last
``<answer>`` of the model's own text) this reads anything in the text: a box in an earlier turn,
"the answer is 12" in plain words, a number printed by a tool.

Each rule below is one function named after the official one it mirrors, written for this
project; tests/test_official_reward.py runs the official files (a copy in tests/fixtures) on the
same inputs. Deliberate differences, none of which changes a verdict on a well-behaved input:

* no time limit of the PRIME grader's own (the official runs ``are_equal_under_sympy`` under a
  10 s ``timeout_limit``, in a child process): the whole reward runs in a sandbox under the
  pool's wall-clock kill, and a kill is reward 0. math-verify keeps its own limits where they
  work, on the main thread (``verify.math_verify_timeout_s``; the sandbox's verifier runs there);
* ``handle_pi`` evaluates the pi-substituted answer only when it is an expression of literals and
  their operators (``_literal_value``: numbers, strings, comparisons, tuples, lists, sets), which
  it evaluates exactly as the official ``eval``; any other text (a builtin's call ``abs(2*pi)``, a
  name, a subscript, a dict, an f-string) stays the string, where the official ``eval`` of model
  text may give a value;
* ``math_equal``'s two ``\\begin{pmatrix}`` branches are left out: the official tests for
  ``"\\begin{pmatrix}"`` in a non-raw string, i.e. with a backspace character, which no answer
  contains, so they never run.

Only the standard library and ``verify`` (likewise) are imported at module level (the sandbox's
zygote loads the verifier); sympy, pylatexenc (the PRIME grader's own dependency) and math-verify
are imported when used.
"""
from __future__ import annotations

import ast
import contextlib
import math
import re
import warnings

from rstarjax.env.verify import is_correct, math_verify_timeout_s

# ---- 1. PRIME: match_answer ---------------------------------------------------------------------
_LEADING_MARKERS = ("answer:", "answer is", "answers are")
_TRAILING_MARKERS = ("is answer", "is the answer", "are answers", "are the answers")
_LAST_MARKERS = ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n")


def last_boxed_content(text: str) -> str | None:
    """prime_math ``_last_boxed_only_string``: the braces' content after the LAST "\\boxed" (or,
    without one, the last "\\fbox"), stripped; None when there is none or its braces never close."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth, left = 0, None
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
            left = i if left is None else left
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[left + 1:i].strip() if left is not None else None
    return None


def _after_last(text: str, marker: str) -> str:
    i = text.lower().rfind(marker)
    return text[i + len(marker):].strip() if i != -1 else text


def match_answer(response: str) -> str:
    """prime_math ``match_answer``: the candidate answer of a free-form response, cut down in the
    official order: after the last "answer:" / "answer is" / "answers are", before the last "is
    the answer" (and kin), then the last box's content if any, then before the last ". ", then
    after the last "is " / "=" / ": " (and kin). (Its "is_matched" flag is unused by the score.)"""
    for marker in _LEADING_MARKERS:
        response = _after_last(response, marker)
    for marker in _TRAILING_MARKERS:
        i = response.lower().rfind(marker)
        if i != -1:
            response = response[:i].strip()
    boxed = last_boxed_content(response)
    if boxed:
        response = boxed
    if ". " in response:
        response = response[:response.lower().rfind(". ")].strip()
    for marker in _LAST_MARKERS:
        response = _after_last(response, marker)
    return response


# ---- 1. PRIME: grade_answer (PRM800K) -------------------------------------------------------------
def _fix_fracs(s: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{72} -> \\frac{1}{72} (Hendrycks' MATH normaliser)."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part[0] == "{":  # an empty part raises, as upstream: the caller keeps the input
            out += part
            continue
        if len(part) < 2:
            return s
        a, b, rest = part[0], part[1], part[2:]
        out += "{" + a + "}{" + b + "}" + rest if b != "{" else "{" + a + "}" + b + rest
    return out


def _fix_a_slash_b(s: str) -> str:
    """"3/4" (two plain integers) -> \\frac{3}{4}."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def _remove_right_units(s: str) -> str:
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    if len(parts) != 2:
        raise ValueError("more than one '\\text{ '")  # upstream asserts; the caller keeps the input
    return parts[0]


def _fix_sqrt(s: str) -> str:
    """\\sqrt3 -> \\sqrt{3}."""
    if "\\sqrt" not in s:
        return s
    parts = s.split("\\sqrt")
    return parts[0] + "".join("\\sqrt" + (p if p[0] == "{" else "{" + p[0] + "}" + p[1:]) for p in parts[1:])


def _strip_string(s: str) -> str:
    """Hendrycks' MATH ``_strip_string``, step by step in its order."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    s = _remove_right_units(s)
    s = s.replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 3" -> "3"
        s = sides[1]
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


_TEXT_WRAPPER = re.compile(r"^\\text\{(?P<text>.+?)\}$")


def mathd_normalize(answer: str | None) -> str | None:
    """prime_math ``math_normalize.normalize_answer``: strip, unwrap \\text{...}, then
    ``_strip_string``; any failure of the latter leaves the (unwrapped) answer as it is."""
    if answer is None:
        return None
    answer = answer.strip()
    try:
        m = _TEXT_WRAPPER.search(answer)
        if m is not None:
            answer = m.group("text").strip()
        return _strip_string(answer)
    except Exception:  # noqa: BLE001 - upstream's bare except: the answer as it stands
        return answer


_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
          "year", "foot", "feet", "inch", "yard", "liter")
_UNIT_PATTERNS = tuple(re.compile(unit + r"(es)?(s)? *(\^[0-9]+)?") for unit in _UNITS)
_THOUSANDS_COMMA = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_MIXED_NUMBER = re.compile("([0-9]) +([0-9])")


def _strip_properly_formatted_commas(expr: str) -> str:
    while True:
        nxt = _THOUSANDS_COMMA.sub(r"\1\3\4", expr)
        if nxt == expr:
            return nxt
        expr = nxt


def _is_float(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _is_int(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except Exception:  # noqa: BLE001 - inf / nan
        return False


def _str_is_int(s: str) -> bool:
    try:
        x = float(_strip_properly_formatted_commas(s))
        return abs(x - int(round(x))) <= 1e-7
    except Exception:  # noqa: BLE001
        return False


def _latex_to_text(expr: str) -> str:
    """prime_math ``_parse_latex``: pylatexenc's rendering of the LaTeX as plain text, with the
    symbols sympy cannot read spelled out."""
    from pylatexenc import latex2text  # the PRIME grader's own dependency

    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    expr = latex2text.LatexNodes2Text().latex_to_text(expr)
    for symbol, name in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*")):
        expr = expr.replace(symbol, name)
    return expr.strip()


def prm800k_normalize(expr: str | None) -> str | None:
    """prime_math ``_normalize`` (PRM800K's grader), step by step in its order."""
    if expr is None:
        return None
    m = _TEXT_WRAPPER.search(expr)
    if m is not None:
        expr = m.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    for unit in _UNIT_PATTERNS:
        expr = unit.sub("", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if len(expr) > 0 and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    if _is_float(expr) and _is_int(float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        with contextlib.suppress(Exception):
            expr = _latex_to_text(expr)
    expr = re.sub("- *", "-", expr)
    expr = _MIXED_NUMBER.sub("\\1+\\2", expr)  # "7 3/4" -> "7+3/4"
    expr = expr.lower()
    if _str_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _allows_sympy(expr: str) -> bool:
    """prime_math ``should_allow_eval``: at most two unknown letters, no "^{" / "^(" and no
    exponent towers or multi-digit exponents (sympy may hang on them)."""
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2 or "^{" in expr or "^(" in expr:
        return False
    return re.search(r"\^[0-9]+\^", expr) is None and re.search(r"\^[0-9][0-9]+", expr) is None


def _equal_under_sympy(gold: str, given: str) -> bool:
    """prime_math ``are_equal_under_sympy``: sympy simplifies (gold) - (given) to 0."""
    try:
        expr = f"({gold})-({given})"
        if not _allows_sympy(expr):
            return False
        import sympy
        from sympy.parsing import sympy_parser

        parsed = sympy_parser.parse_expr(
            expr.replace("^", "**"),
            transformations=sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,))
        return sympy.simplify(parsed) == 0
    except Exception:  # noqa: BLE001 - anything sympy cannot read is "not equal"
        return False


def _split_tuple(expr: str) -> list[str]:
    """prime_math ``split_tuple``: the elements of "(a, b)" / "[a, b]" (thousands commas kept)."""
    expr = _strip_properly_formatted_commas(expr)
    if not expr:
        return []
    brackets = "()[]"
    if len(expr) > 2 and expr[0] in brackets and expr[-1] in brackets and not any(c in expr[1:-1] for c in brackets):
        return [e.strip() for e in expr[1:-1].split(",")]
    return [expr]


_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")


def grade_answer(given: str | None, gold: str) -> bool:
    """prime_math ``grade_answer``: equal after either normalisation, or element by element
    (tuples and intervals) where unreduced fractions must match exactly, an integer gold needs an
    integer answer, and anything else is compared by sympy."""
    if given is None:
        return False
    if mathd_normalize(gold) == mathd_normalize(given):
        return True
    gold_n, given_n = prm800k_normalize(gold), prm800k_normalize(given)
    if gold_n is None:
        return False
    if gold_n == given_n:
        return True
    if not given_n:
        return False
    gold_items, given_items = _split_tuple(gold_n), _split_tuple(given_n)
    if (len(gold_items) > 1 and (gold_n[0] != given_n[0] or gold_n[-1] != given_n[-1])) \
            or len(gold_items) != len(given_items):
        return False
    for g, a in zip(gold_items, given_items):
        if _FRACTION.search(g) and _FRACTION.search(a):
            ok = g == a
        elif _str_is_int(g) != _str_is_int(a):
            ok = False
        else:
            ok = _equal_under_sympy(g, a)
        if not ok:
            return False
    return True


# ---- 1. PRIME: math_equal (grader.py) --------------------------------------------------------------
# The node kinds of an expression of literals and their operators: numbers, strings, True /
# False / None, arithmetic, bitwise, ``not`` / ``and`` / ``or``, every comparison (``in``, ``is``
# and their negations too), tuple, list and set displays. Nothing else: no names, calls,
# attributes, subscripts, comprehensions, lambdas, starred items or f-strings.
_LITERAL_NODES = (ast.Expression, ast.Constant, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Tuple,
                  ast.List, ast.Set, ast.Load, ast.operator, ast.unaryop, ast.boolop, ast.cmpop)


def _is_literal_expression(tree: ast.AST) -> bool:
    """Whether every node of ``tree`` is one of ``_LITERAL_NODES`` (constants: not ``...`` nor
    bytes)."""
    def allowed(node):
        if isinstance(node, ast.Constant):
            return node.value is not Ellipsis and not isinstance(node.value, bytes)
        return isinstance(node, _LITERAL_NODES)
    return all(allowed(node) for node in ast.walk(tree))


def _literal_value(text: str):
    """What Python's ``eval`` gives for ``text`` when it is an expression of literals and their
    operators (``_LITERAL_NODES``): "(1*3.14, 2)" -> (3.14, 2), "3 in (3, 3.14)" -> True;
    ValueError for anything else (names, calls, attributes, subscripts, ...). Stands in for the
    official ``eval`` of model text (module docstring): Python itself evaluates the expression,
    but only once its tree is checked to hold data and operators alone, so what is not data never
    runs. The value is the official one, ``is`` included: CPython's compiler folds and merges
    equal constants ("1*3.14 is 1*3.14" is True), which only compiling the expression repeats."""
    tree = ast.parse(text, mode="eval")
    if not _is_literal_expression(tree):
        raise ValueError("not a literal expression")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)  # '"is" with a literal', as the official eval warns
        code = compile(tree, "<answer>", "eval")
    return eval(code, {"__builtins__": {}}, {})  # noqa: S307 - a tree of literals and operators only


def _handle_pi(s, pi: float):
    """grader ``handle_pi``: "2\\pi" -> 2*pi, "\\pi" -> 1*pi, then the number if it is one."""
    if not (isinstance(s, str) and "\\pi" in s):
        return s
    i = s.find("\\pi")
    while i != -1:
        factor = f"*{pi}" if i > 0 and s[i - 1].isdigit() else f"1*{pi}"
        s = s[:i] + factor + s[i + 3:]
        i = s.find("\\pi", i + 1)
    with contextlib.suppress(Exception):
        s = _literal_value(s)
    return s


def _grader_normalize(answer, pi: float):
    """grader ``normalize``: "$12" -> "12", "12%" -> "12", base subscripts dropped ("101_2" -> 101,
    as upstream: a non-number before "_" raises), pi resolved."""
    if isinstance(answer, str) and re.match(r"\$\d+(\.\d+)?", answer):
        return answer[1:]
    if isinstance(answer, str) and (re.match(r"^\d+(\.\d+)?%$", answer) or re.match(r"^\d+(\.\d+)?\\%$", answer)):
        return answer.replace("\\%", "").replace("%", "")
    if isinstance(answer, str) and "_" in answer:
        answer = int(float(answer.split("_")[0]))
    return _handle_pi(answer, pi)


def _as_number(s) -> float | None:
    """grader ``is_digit``: the float of s without its commas (or "{,}"), else None."""
    text = str(s)
    try:
        return float(text.replace("{,}", "") if "{,}" in text else text.replace(",", ""))
    except ValueError:
        return None


_INTERVALS = (("Interval(", r"^Interval\((.*)\)$", "[{}]"), ("Interval.Ropen(", r"^Interval\.Ropen\((.*)\)$", "[{})"),
              ("Interval.Lopen(", r"^Interval\.Lopen\((.*)\)$", "({}]"),
              ("Interval.open(", r"^Interval\.open\((.*)\)$", "({})"))


def _format_intervals(prediction: str) -> str:
    """grader ``format_intervals``: sympy's Interval(a, b) spellings as bracket notation."""
    for _, pattern, brackets in _INTERVALS:
        m = re.match(pattern, prediction)
        if m:
            return brackets.format(m.group(1))
    return prediction


def _symbolic_equal(a: str, b: str, tolerance: float) -> bool:
    """grader ``symbolic_equal`` AS SHIPPED: always False. The official code parses both sides and
    tries ``simplify(a - b) == 0`` and a numeric ``isclose``, each inside
    ``with timeout_limit(seconds=timeout):``; but that ``timeout_limit`` (the fused grader's own,
    ``fused_compute_score/prime_math/grader.py``, as verl's ``verl/utils/py_functional.py``) is
    only a decorator: ``timeout_limit(...)`` returns a plain function, ``with`` on it raises
    TypeError before anything is compared, and each branch's ``except Exception`` swallows it. So the released reward never judges two spellings equal here
    (``2**5`` vs 32, ``5!`` vs 120 score 0 unless math-verify accepts them); tests/test_official_reward.py
    runs the official grader with a decorator-only stand-in to show it. The paper's reward
    (``verify.is_correct``, reward.mode=answer) compares with math-verify and is unaffected."""
    del a, b, tolerance
    return False


def math_equal(prediction, reference, include_percentage: bool = True, tolerance: float = 1e-4,
               pi: float = math.pi) -> bool:
    """grader ``math_equal``: equal as strings, as numbers (also x100 or /100 with
    include_percentage), element by element for tuples / intervals / comma lists, or symbolically.
    May raise on odd input, as upstream (the caller scores that as wrong)."""
    prediction, reference = _grader_normalize(prediction, pi), _grader_normalize(reference, pi)
    if isinstance(prediction, str) and len(prediction) > 1000:
        prediction = prediction[:1000]
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower():
            return True
        if prediction.replace(" ", "") == reference.replace(" ", ""):
            return True
    with contextlib.suppress(Exception):
        pred_num, ref_num = _as_number(prediction), _as_number(reference)
        if pred_num is not None and ref_num is not None:
            candidates = [ref_num / 100, ref_num, ref_num * 100] if include_percentage else [ref_num]
            for c in candidates:
                with contextlib.suppress(Exception):
                    if math.isclose(c, pred_num, rel_tol=tolerance):
                        return True
            return False
    if not prediction and prediction not in [0, False]:
        return False
    reference, prediction = str(reference).strip(), str(prediction).strip()
    prediction = _format_intervals(prediction)
    pred_s, ref_s = prediction, reference
    if (prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("(")) or (
            prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("[")):
        pred_s, ref_s = pred_s.strip("[]()"), ref_s.strip("[]()")
    for c in "{}()":
        pred_s, ref_s = pred_s.replace(c, ""), ref_s.replace(c, "")
    if pred_s == ref_s:
        return True

    def all_equal(preds, refs):  # every pair compared (a list, not a generator: an error anywhere raises, as upstream)
        return len(preds) == len(refs) and all([math_equal(p, r, include_percentage, tolerance)
                                                for p, r in zip(preds, refs)])

    if prediction and reference and prediction[0] in "([" and prediction[-1] in ")]" \
            and prediction[0] == reference[0] and prediction[-1] == reference[-1]:
        if all_equal(prediction[1:-1].split(","), reference[1:-1].split(",")):
            return True
    if "," in prediction and "," in reference:
        preds = [p.strip() for p in prediction.split(",")]
        refs = [r.strip() for r in reference.split(",")]
        if len(preds) == len(refs):
            return all_equal(preds, refs)
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":
        preds = prediction[prediction.find("(") + 1:-1].split(",")
        refs = reference[1:-1].split(",")
        if len(preds) == len(refs) and all([math_equal(p, r, include_percentage, tolerance)
                                            for p, r in zip(preds, refs)]):
            return True
    return _symbolic_equal(prediction, reference, tolerance)


def prime_score(response: str, gold: str) -> bool:
    """prime_math ``compute_score(...)[0]``: match_answer, then grade_answer, then math_equal
    (with pi as math.pi and as 3.14 when either side writes \\pi); math_equal's errors are wrong."""
    response, gold = str(response), str(gold)
    answer = match_answer(response)
    if grade_answer(answer, gold):
        return True
    try:
        if "\\pi" in answer or "\\pi" in gold:
            return any([math_equal(answer, gold, pi=pi) for pi in (math.pi, 3.14)])  # both run, as upstream
        return math_equal(answer, gold)
    except Exception:  # noqa: BLE001
        return False


# ---- 2. math-verify on the whole text ----------------------------------------------------------------
def math_verify_score(response: str, gold: str) -> bool:
    """verl ``math_verify.compute_score``: math-verify's ``math_metric`` with the gold parsed from
    ``\\boxed{gold}`` as LaTeX and the prediction extracted from the whole response as an expression
    or LaTeX; no gold parsed, or any error, is wrong."""
    from math_verify import grader, parser
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    timeout_s = math_verify_timeout_s()  # the official's default limits, where they work (module doc)
    parser.TIMEOUT_WARNING_SHOWN = grader.TIMEOUT_WARNING_SHOWN = True
    try:
        gold_parsed = parser.parse("\\boxed{" + gold + "}", (LatexExtractionConfig(),), parsing_timeout=timeout_s)
        if not gold_parsed:
            return False
        pred_parsed = parser.parse(response, (ExprExtractionConfig(), LatexExtractionConfig()), parsing_timeout=timeout_s)
        return bool(grader.verify(gold_parsed, pred_parsed, 6, timeout_seconds=timeout_s))
    except Exception:  # noqa: BLE001
        return False


def warm_up() -> None:
    """Import what the official reward uses when it is installed (the heavy zygote calls this, so
    forked verifiers do not pay for it); without pylatexenc nothing happens here, and a run with
    reward.mode=official is refused by its config check."""
    with contextlib.suppress(ImportError):
        import pylatexenc.latex2text  # noqa: F401
        import sympy.parsing.sympy_parser  # noqa: F401


# reward.mode: verify.is_correct (the box in <answer>; "boxed": or the response's last box without
# one) | official_score
REWARD_MODES = ("answer", "boxed", "official")


def score(response: str, gold, mode: str = "answer") -> bool:
    """The reward of ``response``: ``mode="answer"`` is the paper's (eq. 3, ``verify.is_correct``),
    ``"boxed"`` the same with the response's last box where it wrote no <answer> block,
    ``mode="official"`` the official code's (``official_score``)."""
    if mode in ("answer", "boxed"):
        return is_correct(response, gold, outside_answer_block=mode == "boxed")
    if mode == "official":
        return official_score(response, gold)
    raise ValueError(f"reward mode must be one of {REWARD_MODES}, got {mode!r}")


def official_score(response: str, gold) -> bool:
    """microsoft/rStar ``fused_compute_score/__init__.py`` ``compute_score``: the PRIME grader, then
    math-verify, on the whole response text (``response``: the decoded response without special
    tokens, tool outputs included). An error in the PRIME grader falls through to math-verify."""
    if not isinstance(response, str):
        raise TypeError(f"response must be a str, got {type(response).__name__}")
    gold = str(gold)
    try:
        if prime_score(response, gold):
            return True
    except Exception:  # noqa: BLE001 - upstream: an exception of the first grader is "not correct"
        pass
    return math_verify_score(response, gold)
