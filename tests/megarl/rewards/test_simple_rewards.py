import pytest

from megarl.rewards import arithmetic, exact_match


def test_exact_match():
    assert exact_match.compute_score("  Paris\n", "Paris") == 1.0
    assert exact_match.compute_score("paris", "Paris") == 0.0
    assert exact_match.compute_score("paris", " Paris ", case_sensitive=False) == 1.0
    assert exact_match.compute_score("Paris, France", "Paris", case_sensitive=False) == 0.0


def test_problems_are_deterministic_and_correct():
    a = arithmetic.make_arith_problems(50, seed=7)
    assert a == arithmetic.make_arith_problems(50, seed=7)
    assert a != arithmetic.make_arith_problems(50, seed=8)
    for p in a:
        assert p.prompt == f"{p.a}+{p.b}="
        assert int(p.answer) == p.a + p.b
        assert 0 <= int(p.answer) <= 9 and len(p.answer) == 1  # one token of a char-level vocab


def test_problem_ranges_and_ops():
    problems = arithmetic.make_arith_problems(200, seed=0, min_operand=0, max_operand=20, ops="+-*", max_answer=None)
    assert {p.op for p in problems} == {"+", "-", "*"}
    for p in problems:
        assert 0 <= p.a <= 20 and 0 <= p.b <= 20
        assert int(p.answer) == eval(f"{p.a}{p.op}{p.b}") >= 0  # min_answer=0 rejects negatives
    with pytest.raises(ValueError, match="answer"):
        arithmetic.make_arith_problems(5, min_operand=5, max_operand=9, ops="+", max_answer=9)
    with pytest.raises(ValueError, match="ops"):
        arithmetic.make_arith_problems(5, ops="/")


def test_parse_and_score():
    assert arithmetic.parse_int_answer(" 7\n3+4=7") == 7
    assert arithmetic.parse_int_answer("-3") == -3
    assert arithmetic.parse_int_answer("x") is None
    assert arithmetic.compute_score("7", "7") == 1.0
    assert arithmetic.compute_score("8", "7") == 0.0
    assert arithmetic.compute_score("=", "7") == 0.0
    assert arithmetic.compute_score("8", "7", partial_credit_scale=4) == pytest.approx(0.75)
    assert arithmetic.compute_score("5", "7", partial_credit_scale=4) == pytest.approx(0.5)
    assert arithmetic.compute_score("7", "7", partial_credit_scale=4) == 1.0
    assert arithmetic.compute_score("20", "7", partial_credit_scale=4) == 0.0  # clipped at 0
    assert arithmetic.compute_score("?", "7", partial_credit_scale=4) == 0.0
    with pytest.raises(ValueError, match="partial_credit_scale"):
        arithmetic.compute_score("1", "7", partial_credit_scale=0)
