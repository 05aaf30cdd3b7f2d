"""reward.mode=official (issue #27): ``env.official_reward.official_score`` against the official
``compute_score`` itself (tests/fixtures/rstar2_official/compute_score.py: microsoft/rStar
fused_compute_score/__init__.py, the scorer rstar2_agent/reward/server.py imports, with the
prime_math and math_verify graders it calls; the fixtures' README says how the copies match it) on
responses where reading the whole text and reading only the <answer> block disagree, and on the
answer forms the PRIME grader normalises."""
import pytest

from rstarjax.env.official_reward import match_answer, official_score
from rstarjax.env.verify import is_correct

pytest.importorskip("pylatexenc")
from fixtures.rstar2_official.compute_score import compute_score as official_compute_score  # noqa: E402

# (whole response as the official reward manager decodes it: special tokens dropped, tool turns
# kept; gold). The first group is where the whole text and the <answer> block disagree.
WHOLE_VS_ANSWER = [
    # the answer block is right, a later box (in plain reasoning) is wrong: the last box wins
    ("<reason>x</reason><answer>\\boxed{12}</answer> Check: \\boxed{13}", "12"),
    # no box in <answer>, a box earlier in the text
    ("<reason>so \\boxed{7}</reason><answer>7</answer>", "7"),
    # the answer only in plain words
    ("<reason>the answer is 42</reason>", "42"),
    ("<reason>We get x = 5</reason><answer>five</answer>", "5"),
    # a tool printed the right box, the model's own answer is wrong
    ("<reason>run it</reason>\n<tool_call>\n{}\n</tool_call>user\n<tool_response>\nTool call success\n"
     "stdout: \\boxed{204}\n\n</tool_response>\nassistant\n<reason>hmm</reason><answer>\\boxed{205}</answer>",
     "204"),
    # the model's answer is right but a tool output comes after it... no: the answer block's box is
    # followed by words the PRIME extractor cuts at
    ("<answer>\\boxed{3}</answer> so the answer is 4", "3"),
    ("<answer>\\boxed{3}</answer> so the answer is 4", "4"),
    # an unclosed <answer> and a truncated response
    ("<reason>r</reason><answer>\\boxed{9", "9"),
    ("<answer>\\boxed{\\frac{1}{2}}</answer> i.e. 0.5", "\\frac{1}{2}"),
    ("final: 1,000 apples. <answer>\\boxed{1000}</answer>", "1000"),
    ("<answer>\\boxed{32, 349}</answer>", "32349"),
    ("I think it is 17.", "17"),
    ("no number here", "3"),
]
# Forms the PRIME grader (grade_answer / math_equal) and math-verify normalise.
FORMS = [
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}"), ("\\boxed{3/4}", "\\frac{3}{4}"), ("\\boxed{0.75}", "\\frac34"),
    ("\\boxed{6/8}", "3/4"), ("\\boxed{50\\%}", "50"), ("\\boxed{0.5}", "50"), ("\\boxed{\\$12}", "12"),
    ("\\boxed{2\\pi}", "6.283"), ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}"), ("\\boxed{(1, 2)}", "(1,2)"),
    ("\\boxed{[1, 2)}", "[1,2)"), ("\\boxed{(2, 1)}", "(1,2)"), ("\\boxed{x=3}", "3"), ("\\boxed{k = -3}", "-3"),
    ("\\boxed{\\text{(A)}}", "A"), ("\\boxed{10 \\text{ cm}}", "10"), ("\\boxed{5 meters}", "5"),
    ("\\boxed{101_2}", "5"), ("\\boxed{1010_2}", "1010"), ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}"),
    ("\\boxed{2\\sqrt2}", "\\sqrt{8}"), ("\\boxed{x^2+2x+1}", "(x+1)^2"), ("\\boxed{3, 5}", "5, 3"),
    ("\\boxed{3 \\text{ or } 5}", "3, 5"), ("\\boxed{1e3}", "1000"), ("\\boxed{-0}", "0"), ("\\boxed{7.0}", "7"),
    ("\\boxed{12,345}", "12345"), ("\\boxed{1, 000}", "1000"), ("\\boxed{\\infty}", "\\infty"),
    ("\\boxed{2 million}", "2000000"), ("\\boxed{90^\\circ}", "90"), ("\\boxed{\\left( 1,2 \\right)}", "(1,2)"),
    ("The answer is: $\\frac{\\sqrt{3}}{2}$", "\\frac{\\sqrt3}{2}"), ("\\boxed{Interval(0, 1)}", "[0, 1]"),
    ("\\boxed{}", "0"), ("\\boxed{a_b}", "1"),
    # handle_pi evaluates the pi-substituted text: tuples, lists and sets compare element-wise
    ("\\boxed{(3.1416, 6.2832)}", "(\\pi, 2\\pi)"), ("\\boxed{[0, 6.2832]}", "[0, 2\\pi]"),
    ("\\boxed{(\\pi, 2\\pi)}", "(3.1416, 6.2832)"), ("\\boxed{3.1416, 6.2832}", "\\pi, 2\\pi"),
    ("\\boxed{[\\pi, 2)}", "[3.1416, 2)"), ("\\boxed{\\pi < 4}", "True"), ("\\boxed{-\\pi, \\pi}", "(-3.1416, 3.1416)"),
]


@pytest.mark.parametrize("response, gold", WHOLE_VS_ANSWER + FORMS)
def test_official_score_equals_the_official_compute_score(response, gold):
    assert official_score(response, gold) == bool(official_compute_score(response, gold))


def test_the_cases_separate_the_two_readings():
    """The whole-text cases are not a restatement of the paper's reward: on several the two
    disagree, and the official verdicts are mixed."""
    official = [bool(official_compute_score(r, g)) for r, g in WHOLE_VS_ANSWER]
    paper = [is_correct(r, g) for r, g in WHOLE_VS_ANSWER]
    assert sum(o != p for o, p in zip(official, paper)) >= 5
    assert 0 < sum(official) < len(official)


def test_match_answer_cuts_in_the_official_order():
    assert match_answer("so the answer is 12. Done") == "12"
    assert match_answer("x \\boxed{y = 3} z") == "3"
    assert match_answer("42 is the answer") == "42"
    with pytest.raises(TypeError):
        official_score(None, "1")


# The PRIME grader's symbolic_equal as shipped (issue #50): every comparison in it sits inside
# ``with timeout_limit(...)``, which upstream is a decorator only, so the branch always returns
# False. Pairs only that branch could call equal: numbers written as Python / sympy expressions.
SYMBOLIC_ONLY = [("2**5", "32"), ("5!", "120"), ("2*3", "6"), ("sqrt(16)", "4"), ("1+1", "2"),
                 ("10!/8!", "90"), ("x+x", "2*x"), ("7*8", "56")]


def test_the_stand_in_timeout_limit_is_a_decorator_only_as_upstream():
    from fixtures.rstar2_official._no_timeout import timeout_limit

    assert timeout_limit(seconds=1)(len)("ab") == 2
    with pytest.raises(TypeError):
        with timeout_limit(seconds=1):
            pass


@pytest.mark.parametrize("prediction, reference", SYMBOLIC_ONLY)
def test_math_equal_equals_the_official_grader_where_only_symbolic_equal_could_match(prediction, reference):
    from fixtures.rstar2_official.prime_math import grader as official_grader
    from rstarjax.env.official_reward import math_equal

    assert official_grader.symbolic_equal(prediction, reference, 1e-4) is False
    assert math_equal(prediction, reference) == official_grader.math_equal(prediction, reference) is False


@pytest.mark.parametrize("response, gold", [("\\boxed{2**5}", "32"), ("\\boxed{5!}", "120"), ("so x = 2**5", "32")])
def test_official_score_scores_the_dead_branch_as_shipped(response, gold):
    """``2**5`` scores 0 in the official reward (math-verify does not read ``**`` in a box either);
    ``5!`` scores 1 only because math-verify reads the factorial."""
    assert official_score(response, gold) == bool(official_compute_score(response, gold))


# The official handle_pi ``eval``s the pi-substituted answer (fused_compute_score/prime_math/grader.py
# ``handle_pi``): a membership or identity test among literals evaluates to a bool, and
# ``math_equal`` then matches its text ("True", "False") with a gold written so. Expected values by
# Python's own rules, which that eval follows: "3 in (3, 3.14...)" is True; "1 in [3.14...]" is
# False; "1*3.14... is 1*3.14..." is True (the compiler folds both products into one constant
# object); two list displays are two objects, so "is" between them is False.
MEMBERSHIP_AND_IDENTITY = [
    ("3 in (3, \\pi)", "True", True), ("2 not in (1, \\pi)", "True", True), ("1 in [\\pi]", "False", True),
    ("3 in (3, \\pi)", "False", False), ("\\pi is \\pi", "True", True), ("\\pi is \\pi", "False", False),
    ("\\pi is not \\pi", "False", True), ("[\\pi] is [\\pi]", "False", True), ("(\\pi, 1) is (\\pi, 1)", "True", True),
]


@pytest.mark.parametrize("prediction, reference, expected", MEMBERSHIP_AND_IDENTITY)
def test_math_equal_evaluates_in_and_is_as_the_official_eval(prediction, reference, expected):
    from fixtures.rstar2_official.prime_math import grader as official_grader
    from rstarjax.env.official_reward import math_equal

    assert math_equal(prediction, reference) is expected
    assert official_grader.math_equal(prediction, reference) is expected


@pytest.mark.parametrize("response, gold, expected", [
    ("The answer is 3 in (3, \\pi)", "True", True), ("The answer is 2 not in (1, \\pi)", "True", True),
    ("The answer is 1 in [\\pi]", "False", True), ("The answer is 3 in (3, \\pi)", "False", False)])
def test_official_score_reads_in_and_not_in_as_the_official_compute_score(response, gold, expected):
    assert official_score(response, gold) is expected
    assert bool(official_compute_score(response, gold)) is expected


def test_the_literal_evaluator_runs_no_names_calls_or_subscripts():
    from rstarjax.env.official_reward import _literal_value

    assert _literal_value("(1*3.14, 2)") == (3.14, 2)
    for text in ("abs(2)", "x", "(1, 2)[0]", "__import__('os')", "().__class__", "[i for i in (1, 2)]"):
        with pytest.raises(ValueError):
            _literal_value(text)


# PRIME's math_equal accepts a number within rel_tol 1e-4 of the gold, the gold / 100 or the gold
# x 100 (include_percentage): wrong integers score 1 in the official reward (docs/algorithm.md).
# Expected by that rule: 500 = 5 x 100, 0.05 = 5 / 100, 4200 = 42 x 100, 100001 / 100000 - 1 = 1e-5,
# 123456789 / 123450000 - 1 = 5.5e-5; 501 and 4201 are none of them.
@pytest.mark.parametrize("answer, gold, expected", [
    ("500", "5", True), ("0.05", "5", True), ("4200", "42", True), ("100001", "100000", True),
    ("123456789", "123450000", True), ("501", "5", False), ("4201", "42", False)])
def test_official_score_credits_the_gold_times_or_over_100_as_the_official_code(answer, gold, expected):
    response = "so \\boxed{" + answer + "}"
    assert official_score(response, gold) is expected
    assert bool(official_compute_score(response, gold)) is expected
