import pytest

from megarl.rewards import gsm8k

MATCH_42 = [
    "So she has 40 + 2 = 42 apples.\n#### 42",
    "#### 42.0",
    "####42",
    "#### $42",
    "#### 42.",
    "#### 5\nwait, I made a mistake.\n#### 42",  # the last #### counts
    "The total is 42 dollars. #### 42 dollars",
]
NO_MATCH_42 = [
    "The answer is 42",  # strict needs ####
    "#### 43",
    "#### 4.2",
    "#### 420",
    "#### -42",
    "#### 42\n#### 41",
    "",
]


@pytest.mark.parametrize("response", MATCH_42)
def test_strict_matches(response):
    assert gsm8k.compute_score(response, "42") == 1.0


@pytest.mark.parametrize("response", NO_MATCH_42)
def test_strict_rejects(response):
    assert gsm8k.compute_score(response, "42") == 0.0


def test_commas_in_numbers_both_sides():
    assert gsm8k.compute_score("#### 1,000", "1000") == 1.0
    assert gsm8k.compute_score("#### 1000", "1,000") == 1.0
    assert gsm8k.compute_score("#### 1,234,567.50", "1234567.5") == 1.0
    assert gsm8k.compute_score("#### 1,001", "1000") == 0.0


def test_negative_and_decimal_answers():
    assert gsm8k.compute_score("#### -3", "-3") == 1.0
    assert gsm8k.compute_score("#### 0.5", ".5") == 1.0
    assert gsm8k.compute_score("#### 3", "-3") == 0.0


def test_flexible_falls_back_to_last_number():
    assert gsm8k.extract_answer("The answer is 42", "strict") is None
    assert gsm8k.extract_answer("The answer is 42", "flexible") == "42"
    assert gsm8k.extract_answer("5 apples and 12 pears make 17.", "flexible") == "17"
    assert gsm8k.extract_answer("17 apples, then 3 more", "flexible") == "3"
    assert gsm8k.extract_answer("it costs $1,250.", "flexible") == "1250"
    assert gsm8k.extract_answer("#### 8 but maybe 9", "flexible") == "8"  # #### wins over the last number
    assert gsm8k.extract_answer("no digits here.", "flexible") is None
    assert gsm8k.compute_score("so 6*7 = 42", "42", method="flexible") == 1.0
    assert gsm8k.compute_score("so 42 = 6*7", "42", method="flexible") == 0.0  # last number is 7


def test_format_score_only_when_an_answer_was_given():
    assert gsm8k.compute_score("#### 41", "42", format_score=0.1) == 0.1
    assert gsm8k.compute_score("I don't know", "42", format_score=0.1) == 0.0
    assert gsm8k.compute_score("#### 42", "42", format_score=0.1) == 1.0


def test_ground_truth_extraction():
    assert gsm8k.extract_ground_truth("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"
    assert gsm8k.extract_ground_truth("#### 1,234") == "1234"
    assert gsm8k.extract_ground_truth("72") == "72"
    with pytest.raises(ValueError, match="####"):
        gsm8k.extract_ground_truth("no final answer here")
    with pytest.raises(ValueError, match="strict"):
        gsm8k.extract_answer("#### 1", method="loose")
