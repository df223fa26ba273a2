"""GSM8K scoring: pull the final number out of a response and compare it with the reference.

GSM8K references end in ``#### 42``; models are prompted to do the same. ``strict`` accepts only
that convention (a reward that also teaches the format); ``flexible`` falls back to the last
number in the response. Numbers may carry thousands commas, a ``$`` or a trailing ``.``, and are
compared as exact decimals (``42.0`` equals ``42``, ``1,000`` equals ``1000``).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A number: optional sign, digits with optional thousands commas, optional decimals; or ".5".
_NUMBER = r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_HASH_ANSWER = re.compile(r"####\s*\$?\s*(" + _NUMBER + r")")
_ANY_NUMBER = re.compile(_NUMBER)


def normalize_number(text: str) -> str:
    """``"$1,234.50."`` -> ``"1234.50"``: drop commas, ``$``, spaces and a trailing period."""
    return text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The final answer of a response as a normalised number string, or None if it has none.

    ``strict``: the number after the last ``####``. ``flexible``: that, or else the last number
    anywhere in the response.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"GSM8K extraction method must be 'strict' or 'flexible', got {method!r}")
    hashed = _HASH_ANSWER.findall(solution_str)
    if hashed:
        return normalize_number(hashed[-1])
    if method == "flexible":
        numbers = [n for n in _ANY_NUMBER.findall(solution_str) if n.strip(",.-")]
        if numbers:
            return normalize_number(numbers[-1])
    return None


def extract_ground_truth(answer: str) -> str:
    """The reference number of a GSM8K ``answer`` field (``"...#### 1,000"`` -> ``"1000"``).

    A bare number (already extracted) is returned normalised. ValueError if there is neither.
    """
    found = extract_answer(str(answer), method="strict")
    if found is None:
        bare = normalize_number(str(answer))
        if re.fullmatch(_NUMBER, bare):
            return bare
        raise ValueError(f"GSM8K answer has no '#### <number>' final answer: {str(answer)[-80:]!r}")
    return found


def numbers_equal(a: str, b: str) -> bool:
    """Exact decimal equality of two number strings (after normalisation); string equality otherwise."""
    a, b = normalize_number(a), normalize_number(b)
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return a == b


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` if the extracted answer equals the reference, ``format_score`` if an answer was
    found but is wrong, 0.0 if no answer was found."""
    answer = extract_answer(solution_str, method=method)
    if answer is None:
        return 0.0
    return score if numbers_equal(answer, extract_ground_truth(ground_truth)) else format_score
