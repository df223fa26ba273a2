"""A synthetic arithmetic task for the quickstart: prompts ``"3+4="``, answers ``"7"``.

It exists so that a tiny model trained from scratch on a CPU shows its reward rising under
GRPO within a few steps. Two choices make that possible: the operand and answer ranges are
chosen so that the answer is one token of a character-level vocabulary (``max_answer=9`` with
``+`` keeps every answer a single digit), and the reward can be dense: ``partial_credit_scale=s``
scores ``max(0, 1 - |pred - target| / s)`` instead of 1/0, so that near misses already pull
the policy towards the right answer. Problems are a pure function of the seed.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_INT = re.compile(r"-?\d+")


@dataclass(frozen=True)
class ArithProblem:
    """One problem: ``prompt`` (``"a+b="``) and its ``answer`` as a string."""

    a: int
    op: str
    b: int
    prompt: str
    answer: str


def make_arith_problems(
    num: int,
    seed: int = 0,
    min_operand: int = 0,
    max_operand: int = 9,
    ops: tuple[str, ...] | str = ("+",),
    min_answer: int = 0,
    max_answer: int | None = 9,
) -> list[ArithProblem]:
    """``num`` problems drawn deterministically from ``seed``.

    Operands are uniform in ``[min_operand, max_operand]``, the operator uniform in ``ops``, and a
    draw whose answer falls outside ``[min_answer, max_answer]`` is redrawn (``max_answer=None``:
    no upper bound). The defaults give single-digit sums (0..9): every answer is one token of a
    character-level vocabulary.
    """
    ops = tuple(ops)
    unknown = [op for op in ops if op not in _OPS]
    if not ops or unknown:
        raise ValueError(f"arithmetic ops must be a non-empty subset of {sorted(_OPS)}, got {ops!r}")
    if num < 0 or min_operand > max_operand:
        raise ValueError(f"need num >= 0 and min_operand <= max_operand, got {num}, [{min_operand}, {max_operand}]")
    rng = random.Random(seed)
    problems: list[ArithProblem] = []
    rejected = 0
    while len(problems) < num:
        a = rng.randint(min_operand, max_operand)
        b = rng.randint(min_operand, max_operand)
        op = rng.choice(ops)
        value = _OPS[op](a, b)
        if value < min_answer or (max_answer is not None and value > max_answer):
            rejected += 1
            if rejected > 10_000 + 100 * num:
                raise ValueError(
                    f"operands in [{min_operand}, {max_operand}] with ops {ops} almost never give an answer in "
                    f"[{min_answer}, {max_answer}]; widen the answer range or narrow the operands"
                )
            continue
        problems.append(ArithProblem(a, op, b, f"{a}{op}{b}=", str(value)))
    return problems


def parse_int_answer(solution_str: str) -> int | None:
    """The first integer in the response (``" 7\\n3+4=..."`` -> 7), or None."""
    match = _INT.search(str(solution_str))
    return int(match.group()) if match else None


def compute_score(solution_str: str, ground_truth: str | int, partial_credit_scale: float | None = None) -> float:
    """1.0 for the right answer, else 0.0; with ``partial_credit_scale=s``,
    ``max(0, 1 - |pred - target| / s)``. A response without a number scores 0.0."""
    pred = parse_int_answer(solution_str)
    if pred is None:
        return 0.0
    target = int(str(ground_truth).strip())
    if partial_credit_scale is None:
        return 1.0 if pred == target else 0.0
    if partial_credit_scale <= 0:
        raise ValueError(f"partial_credit_scale must be > 0, got {partial_credit_scale}")
    return max(0.0, 1.0 - abs(pred - target) / float(partial_credit_scale))
