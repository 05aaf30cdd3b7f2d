"""Answer extraction and math-verify checking (in-process, `is_correct`), independent of the pool
(whose wall-clock bound on the same check is tested in tests/test_env_pool.py)."""
import pytest

from rstarjax.env import extract_final_answer, find_boxed, is_correct


@pytest.mark.parametrize(
    "response, gold",
    [
        (r"<answer>\boxed{\frac{1}{2}}</answer>", "0.5"),
        (r"<answer>\boxed{0.5}</answer>", r"\frac{1}{2}"),
        (r"<answer>\boxed{1,000}</answer>", "1000"),
        (r"<answer>\boxed{1000}</answer>", "1,000"),
        (r"<answer>\boxed{12,345}</answer>", "12345"),
        (r"<answer>$\boxed{ 110 }$</answer>", "110"),
        (r"<answer>\boxed{\text{42}}</answer>", "42"),
        (r"<answer>\boxed{-7}</answer>", "-7"),
        (r"<answer>\boxed{x^2 + 2x + 1}</answer>", "(x+1)^2"),
        (r"<answer>\boxed{\sqrt{8}}</answer>", r"2\sqrt{2}"),
        (r"<answer>\boxed{\frac{4}{2}}</answer>", "2"),
    ],
)
def test_equivalent_forms_are_correct(response, gold):
    assert is_correct(response, gold) is True


@pytest.mark.parametrize(
    "response, gold",
    [
        (r"<answer>\boxed{3}</answer>", "4"),
        (r"<answer>\boxed{1,001}</answer>", "1000"),
        # math-verify's own test cases: a comma and a space separate two numbers (issue #27)
        (r"<answer>\boxed{32, 349}</answer>", "32349"),
        (r"<answer>\boxed{1, 000}</answer>", "1000"),
        (r"<answer>\boxed{0.51}</answer>", r"\frac{1}{2}"),
        (r"<answer>110</answer>", "110"),  # no box
        ("no answer at all", "1"),
        (r"<answer>\boxed{}</answer>", "1"),
        (r"<answer>\boxed{12</answer>", "12"),  # unbalanced
        # the box outside <answer> does not count when an <answer> block exists
        (r"I guess \boxed{5}. <answer>\boxed{6}</answer>", "5"),
        # no <answer> block, no answer (paper §2.2: "\boxed{} within the <answer> tag")
        (r"the answer is \boxed{24}", "24"),
    ],
)
def test_wrong_or_missing_answers(response, gold):
    assert is_correct(response, gold) is False


def test_reward_mode_boxed_reads_the_last_box_where_there_is_no_answer_block():
    """reward.mode=boxed, for a policy that writes no <answer> tags: the response's last box;
    where an <answer> block exists it alone counts, as in the paper's mode."""
    from rstarjax.env.official_reward import score

    assert score(r"the answer is \boxed{24}", "24", "boxed") and not score(r"the answer is \boxed{24}", "24")
    assert not score(r"I guess \boxed{5}. <answer>\boxed{6}</answer>", "5", "boxed")
    assert extract_final_answer(r"so \boxed{7}", outside_answer_block=True) == "7"


def test_several_boxes_last_one_counts():
    assert is_correct(r"<answer>\boxed{1} or rather \boxed{2}</answer>", "2") is True
    assert is_correct(r"<answer>\boxed{1} or rather \boxed{2}</answer>", "1") is False


def test_extraction_handles_nested_braces_and_fbox():
    assert find_boxed(r"\boxed{\frac{a}{b}} and \fbox{c}") == [r"\frac{a}{b}", "c"]
    assert extract_final_answer(r"<answer>\boxed{\dfrac{1}{\sqrt{2}}}</answer>") == r"\dfrac{1}{\sqrt{2}}"
    assert extract_final_answer("nothing") is None


def test_works_off_the_main_thread():
    # math-verify's own timeouts use signal.alarm, which fails off the main thread and silently
    # yields 0 (the verl/TRL bug); ours are disabled, so a worker thread gets the true verdict.
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(is_correct, r"<answer>\boxed{\frac{1}{2}}</answer>", "0.5").result(60) is True


def test_pure_check_on_the_sympy_and_integer_paths():
    assert is_correct(r"<answer>\boxed{\frac{1}{2}}</answer>", "0.5") is True
    assert is_correct(r"<answer>\boxed{7}</answer>", "8") is False


def _math_verify_verdict(answer: str, gold: str) -> bool:
    """math-verify itself on the boxed answer (the paper's reward), the reference the integer fast
    path must agree with."""
    from math_verify import parse, verify

    return bool(verify(parse("\\boxed{" + gold + "}", parsing_timeout=None),
                       parse("\\boxed{" + answer + "}", parsing_timeout=None), timeout_seconds=None))


@pytest.mark.parametrize("answer, gold, verdict", [
    ("1 000", "1000", True), ("1000", "1 000", True), ("12 345", "12345", True), (r"1\,000", "1000", True),
    ("1~000", "1000", True), ("1 000 000", "1000000", True), ("- 3", "-3", True), ("$ 42 $", "42", True),
    (r"\text{ 42 }", "42", True), (r"1\,000", "1 000", True),
    # math-verify reads digits split by white space as a sum or product ("3 4" -> 7, "1 000" -> 1*0):
    # never credited against an integer
    ("1 2", "12", False), ("1 000", "0", False), (r"1\,000", "0", False), ("7 0", "0", False),
    ("3 4", "7", False), ("2 3", "5", False), ("10 00", "1000", False), ("1 0000", "10000", False)])
def test_digits_split_by_white_space_are_an_integer_only_in_thousands_groups(answer, gold, verdict):
    """SI-style thousands groups ("1 000", "1\\,000") are the integer; any other split ("1 2", a
    hedge or two numbers) is no integer and never equals one, where math-verify would read a sum
    or a product (the verdicts here are the integers the text writes, not math-verify's)."""
    assert is_correct(rf"<answer>\boxed{{{answer}}}</answer>", gold) is verdict


@pytest.mark.parametrize("answer, gold", [("١٢", "12"), ("１２", "12"), ("12", "１２"), ("𝟏𝟐", "12"), ("٣", "3")])
def test_digits_of_other_scripts_get_math_verifys_verdict(answer, gold):
    """Python's ``\\d`` is any Unicode digit (Arabic-Indic, full-width, mathematical bold): the
    integer fast path reads ASCII digits only, as math-verify does."""
    assert is_correct(rf"<answer>\boxed{{{answer}}}</answer>", gold) is _math_verify_verdict(answer, gold)


def test_the_zygotes_warm_up_leaves_no_import_to_a_forked_verification():
    """Every verification runs in a sandbox forked from the zygote after ``warm_up``: a module
    sympy imports on first use would be imported again by each one (0.2 s for a polynomial's
    comparison). In a fresh process: after warm_up, checks of other answers of each kind import
    nothing new."""
    import subprocess
    import sys

    script = r"""
import sys
from rstarjax.env import verify
verify.warm_up()
before = set(sys.modules)
for answer, gold in [("(x-1)^2", "x^2-2x+1"), ("[0, 3)", "[0,3)"), ("\\{3, 4\\}", "\\{4,3\\}"),
                     ("\\begin{pmatrix}0&1\\\\1&0\\end{pmatrix}", "\\begin{pmatrix}0&1\\\\1&0\\end{pmatrix}"),
                     ("\\cos(\\pi/3)", "0.5"), ("7\\text{ m}", "7"), ("\\frac{3}{4}", "0.75")]:
    assert verify.is_correct("<answer>\\boxed{" + answer + "}</answer>", gold), answer
print(sorted(m for m in set(sys.modules) - before if m.startswith(("sympy", "math_verify", "latex2sympy"))))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


# ---- the verifier's self-check at start ---------------------------------------------------------
@pytest.fixture
def broken_latex_backend(monkeypatch):
    """math-verify with its LaTeX backend failing (as with an antlr4 runtime latex2sympy2_extended
    does not support): it logs the error and returns no parse. Its parse caches are emptied before
    and after, so no cached parse hides the breakage or outlives it."""
    import logging

    from math_verify import parser

    def broken(*args, **kwargs):
        raise ImportError("antlr4 runtime version mismatch (simulated)")

    def clear_caches():
        for cached in (parser.parse_latex_cached, parser.parse_expr_cached, parser.extract_latex):
            cached.cache_clear()

    clear_caches()
    monkeypatch.setattr(parser, "latex2sympy", broken)
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)
    monkeypatch.undo()
    clear_caches()


def test_warm_up_refuses_a_broken_latex_backend_naming_the_pair(broken_latex_backend):
    """Without the check the pool would start and every non-integer answer would score 0. The
    broken backend still gets \\frac{1}{2} = 0.5 right (math-verify reads the number without
    it), so the first pair to fail is the polynomial: x^2+2x+1 = (x+1)^2."""
    from rstarjax.env import verify

    with pytest.raises(RuntimeError, match=r"self-check failed: math-verify judges 'x\^2\+2x\+1' unequal to "
                                           r"'\(x\+1\)\^2'"):
        verify.warm_up()


def test_warm_up_passes_on_a_working_install():
    from rstarjax.env import verify

    verify.warm_up()


def test_warm_up_puts_no_time_limit_on_its_self_check(monkeypatch):
    """The zygote warms up on its main thread, where math-verify's 5 s limit applies, and a timed
    out comparison reads as "unequal": a first comparison slowed by a busy machine would have
    stopped the pool as a broken install. Each warm-up comparison runs with no limit."""
    from math_verify import grader
    from rstarjax.env import verify

    limits = []
    real_verify = grader.verify

    def recording_verify(*args, timeout_seconds=None, **kwargs):
        limits.append(timeout_seconds)
        return real_verify(*args, timeout_seconds=timeout_seconds, **kwargs)

    monkeypatch.setattr("math_verify.verify", recording_verify)
    monkeypatch.setattr(verify, "math_verify_timeout_s", lambda: 1)
    verify.warm_up()
    assert limits and all(limit is None for limit in limits), limits


# ---- math-verify's own time limits where its alarm works ----------------------------------------
@pytest.mark.slow
def test_a_pathological_answer_scores_0_within_math_verifys_limit_on_the_main_thread():
    """sympy evaluates the tower (it ran past the pool's 30 s kill without a limit); on the main
    thread math-verify's own 5 s limit gives up first: not equal, well before the kill. In a
    child process, on its main thread, so that a hang fails the test instead of stalling it."""
    import subprocess
    import sys

    script = r"""
import threading, time
from rstarjax.env.verify import is_correct
assert threading.current_thread() is threading.main_thread()
start = time.monotonic()
print(is_correct(r"<answer>\boxed{9^{9^{9^{9}}}}</answer>", "5"), time.monotonic() - start)
"""
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the verification ran past 60 s: math-verify's own time limit did not apply")
    assert out.returncode == 0, out.stderr[-2000:]
    verdict, seconds = out.stdout.split()
    assert verdict == "False" and float(seconds) < 10


def test_math_verify_time_limit_only_on_the_main_thread():
    import concurrent.futures

    from rstarjax.env.verify import MATH_VERIFY_TIMEOUT_S, math_verify_timeout_s

    assert MATH_VERIFY_TIMEOUT_S == 5  # math-verify's own default (parse and verify)
    assert math_verify_timeout_s() == 5
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(math_verify_timeout_s).result(10) is None


# ---- which <answer> block holds the answer ------------------------------------------------------
@pytest.mark.parametrize("response, answer", [
    # a later mention of the tag opens a box-less block that runs to the end of the text
    (r"<answer>\boxed{42}</answer> (I wrapped it in an <answer> tag as asked.)", "42"),
    (r"<answer>\boxed{42}</answer><answer>", "42"),
    (r"<answer>\boxed{41}</answer> no, <answer>\boxed{42}</answer>", "42"),
    (r"<answer>\boxed{41}</answer> then <answer>\boxed{42", "41"),  # the last box is not complete
    (r"<answer>\boxed{41 is wrong; \boxed{42}</answer>", None),  # no complete box anywhere
    (r"<answer>\boxed 42</answer>", None),
    (r"<answer>42</answer>", None),
])
def test_the_last_answer_block_holding_a_complete_box_counts(response, answer):
    assert extract_final_answer(response) == answer


def test_a_stray_answer_tag_after_the_answer_keeps_the_reward():
    assert is_correct(r"<answer>\boxed{42}</answer> (I wrapped it in an <answer> tag.)", "42") is True
    assert is_correct(r"<answer>\boxed{42}</answer><answer>", "42") is True
    # with no <answer> block holding a box, still no answer (reward.mode=answer)
    assert is_correct(r"\boxed{42} <answer>42</answer>", "42") is False


# ---- integers of any length ---------------------------------------------------------------------
def test_a_gold_past_pythons_int_string_limit_is_compared_not_raised():
    """int() refuses over 4,300 digits (sys.get_int_max_str_digits): every rollout of such a
    problem was an infrastructure error. Compared as digits, no answer the verifier reads
    (at most MAX_ANSWER_CHARS characters) equals it."""
    import sys

    from rstarjax.env.verify import integer_text, normalize_integer

    huge = "9" * 5000
    assert is_correct(r"<answer>\boxed{5}</answer>", huge) is False
    assert is_correct(r"<answer>\boxed{" + "9" * 900 + "}</answer>", huge) is False
    assert integer_text(huge) == huge and integer_text("-000" + huge) == "-" + huge
    if hasattr(sys, "get_int_max_str_digits"):
        assert normalize_integer(huge) is None
    assert normalize_integer("9" * 900) == 10**900 - 1


@pytest.mark.parametrize("text, digits", [
    (r"\text{42}", "42"), ("42.", "42"), ("42.0", "42"), ("0042.000", "42"), ("\u22125", "-5"), ("-0", "0"),
    (r"\boxed{1{,}000}", "1000"), (r"$\boxed{\text{7}}$", "7"), ("12,345.00", "12345"), ("+5", "5"),
    ("1,00", None), ("1{,}00", None), ("4 2", None), ("1e3", None), ("42^\\circ", None), ("\u0664\u0662", None),
])
def test_integer_text_reads_integers_as_the_reward_and_the_data_filter_do(text, digits):
    from rstarjax.env.verify import integer_text

    assert integer_text(text) == digits


@pytest.mark.parametrize("answer, gold", [("\u22125", "-5"), ("-5", "\u22125"), ("42.0", "42"), (r"\boxed{42}", "42")])
def test_new_integer_spellings_keep_math_verifys_verdict(answer, gold):
    """Spellings the integer fast path now reads, which math-verify already judged equal."""
    assert is_correct(rf"<answer>\boxed{{{answer}}}</answer>", gold) is True
    assert _math_verify_verdict(answer, gold) is True
