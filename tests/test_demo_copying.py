"""benchmarks/demo_copying.py: which question digits the policy copies into its program."""
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import demo_copying  # noqa: E402


def test_a_digit_counts_as_copied_when_the_argmax_before_it_is_that_digit():
    # "by 40 or 7?" -> code print(40+7): the argmax before "4" is 4 (copied), before "0" it
    # is 9 (miscopied), before "7" it is 7; the question's numbers outside the code are ignored
    pieces = ["by ", "4", "0", " or ", "7", "?", "print(", "4", "0", "+", "7", ")"]
    ids = np.array([20, 4, 0, 21, 7, 22, 23, 4, 0, 24, 7, 25])
    predicted = np.array([0, 0, 0, 0, 0, 0, 4, 9, 0, 7, 0, 0])
    got = demo_copying.copied_digits(ids, predicted, pieces, "by 40 or 7?", "print(40+7)")
    assert got == {0: [True, False], 1: [True]}


def test_numbers_absent_from_the_code_and_the_literal_one_are_skipped():
    pieces = ["from ", "1", " to ", "5", "?", "range(", "1", ", ", "6", ")"]
    ids = np.array([30, 1, 31, 5, 32, 33, 1, 34, 6, 35])
    got = demo_copying.copied_digits(ids, ids[1:].tolist() + [0], pieces, "from 1 to 5?",
                                     "range(1, 6)")
    assert got == {}
