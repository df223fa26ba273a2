import pytest

from megarl.rewards import math_answer as m

EQUIVALENT = [
    ("\\frac{1}{2}", "0.5"),
    ("\\frac{1}{2}", "1/2"),
    ("\\dfrac{1}{2}", "\\frac12"),
    ("\\tfrac{3}{4}", "0.75"),
    (".5", "\\frac{1}{2}"),
    ("-\\frac{1}{2}", "-0.5"),
    ("\\frac{-1}{2}", "-1/2"),
    ("\\frac{4}{8}", "\\frac{1}{2}"),
    ("\\left( 1, 2 \\right)", "(1,2)"),
    ("\\left[ \\frac{1}{2}, 3 \\right)", "[0.5, 3)"),
    ("90^\\circ", "90"),
    ("90^{\\circ}", "90"),
    ("10\\%", "10"),
    ("\\$5", "5"),
    ("\\text{(A)}", "(A)"),
    ("5 \\text{ cm}", "5"),
    ("\\textbf{yes}", "yes"),
    ("x = 3", "3"),
    ("3.", "3"),
    ("2.50", "2.5"),
    ("1,000", "1000"),
    ("1,234,567", "1234567"),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}"),
    ("\\frac{1}{\\frac{1}{2}}", "1/(1/2)"),
    ("\\{1,2\\}", "\\{1, 2\\}"),
    ("\\boxed{7}", "7"),
    ("  7  ", "7"),
]
NOT_EQUIVALENT = [
    ("2", "3"),
    ("\\frac{1}{3}", "0.33"),
    ("(1,2)", "(2,1)"),
    ("(1,2)", "[1,2]"),
    ("1,001", "1000"),
    ("\\frac{1}{2}", "2"),
    ("x+1", "x+2"),
    ("\\sqrt{2}", "\\sqrt{3}"),
    ("12", "1,2"),
    ("-1/2", "1/2"),
]


@pytest.mark.parametrize("a,b", EQUIVALENT)
def test_equivalent(a, b):
    assert m.is_equiv(a, b), (m.normalize_math_answer(a), m.normalize_math_answer(b))
    assert m.is_equiv(b, a)


@pytest.mark.parametrize("a,b", NOT_EQUIVALENT)
def test_not_equivalent(a, b):
    assert not m.is_equiv(a, b), (m.normalize_math_answer(a), m.normalize_math_answer(b))


def test_boxed_extraction():
    assert m.extract_boxed_answer("so \\boxed{\\frac{1}{\\sqrt{2}}} is it") == "\\frac{1}{\\sqrt{2}}"
    assert m.extract_boxed_answer("first \\boxed{1}, finally \\boxed{2}") == "2"
    assert m.extract_boxed_answer("\\fbox{x^{2}}") == "x^{2}"
    assert m.extract_boxed_answer("$\\boxed 5$") == "5"
    assert m.extract_boxed_answer("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert m.extract_boxed_answer("\\boxed{1") is None  # unbalanced
    assert m.extract_boxed_answer("the answer is 5") is None
    assert m.extract_boxed_answer("\\boxed{}") == ""


def test_compute_score():
    assert m.compute_score("Thus the answer is $\\boxed{\\dfrac{1}{2}}$.", "0.5") == 1.0
    assert m.compute_score("$\\boxed{0.5}$", "The answer is $\\boxed{\\frac12}$.") == 1.0  # boxed reference
    assert m.compute_score("\\boxed{1} then \\boxed{3}", "3") == 1.0
    assert m.compute_score("\\boxed{3} then \\boxed{1}", "3") == 0.0
    assert m.compute_score("the answer is 1/2", "\\frac{1}{2}") == 0.0  # no box, no score
    assert m.compute_score("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3,\\frac{\\pi}{2})") == 1.0


def test_to_rational():
    from fractions import Fraction

    assert m.to_rational("-3/4") == Fraction(-3, 4)
    assert m.to_rational("0.25") == Fraction(1, 4)
    assert m.to_rational("1/0") is None
    assert m.to_rational("x") is None
