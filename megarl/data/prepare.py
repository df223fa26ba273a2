"""Turn datasets a user already has into megarl's prompt format (the logic of tools/prepare_data.py).

The format, one row per prompt (what ``PromptDataset`` reads by default)::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "<question> <instruction>"}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, ...}}

Sources: GSM8K-style rows (``question``, ``answer`` ending in ``#### N``), MATH-style rows
(``problem``, ``solution`` with a ``\\boxed{}`` answer), and the synthetic arithmetic task of
the quickstart (``prompt`` is the plain string ``"3+4="``: tiny models have no chat template).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

from megarl.data.io import read_records, write_records
from megarl.rewards import arithmetic, gsm8k, math_answer

logger = logging.getLogger(__name__)

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
KINDS = ("gsm8k", "math")


def _field(row: dict, key: str, origin: str, kind: str) -> str:
    if key not in row or row[key] is None:
        raise ValueError(f"{origin}: {kind} rows need a {key!r} field (fields: {sorted(row)})")
    return str(row[key])


def gsm8k_record(
    row: dict, index: int, split: str = "train", data_source: str = "openai/gsm8k",
    instruction: str = GSM8K_INSTRUCTION, origin: str = "row",
) -> dict:
    """A GSM8K row (``question``, ``answer``) as a prompt record; ground truth from ``#### N``."""
    question = _field(row, "question", origin, "GSM8K")
    answer = _field(row, "answer", origin, "GSM8K")
    try:
        truth = gsm8k.extract_ground_truth(answer)
    except ValueError as exc:
        raise ValueError(f"{origin}: {exc}") from None
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": f"{question} {instruction}".strip()}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
    }


def math_record(
    row: dict, index: int, split: str = "train", data_source: str = "lighteval/MATH",
    instruction: str = MATH_INSTRUCTION, origin: str = "row",
) -> dict:
    """A MATH row (``problem``, ``solution``) as a prompt record; ground truth is the last
    ``\\boxed{}`` of the solution (unnormalised: the reward normalises both sides)."""
    problem = _field(row, "problem", origin, "MATH")
    solution = _field(row, "solution", origin, "MATH")
    truth = math_answer.extract_boxed_answer(solution)
    if truth is None:
        raise ValueError(f"{origin}: the MATH solution has no \\boxed{{...}} answer: ...{solution[-80:]!r}")
    extra = {"split": split, "index": index, "problem": problem, "solution": solution}
    for key in ("level", "type"):
        if key in row:
            extra[key] = str(row[key])
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": f"{problem} {instruction}".strip()}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": extra,
    }


_CONVERTERS = {"gsm8k": gsm8k_record, "math": math_record}


def convert_files(
    inputs: Sequence[str | Path], output: str | Path, kind: str, split: str = "train",
    data_source: str | None = None, skip_invalid: bool = False,
) -> tuple[int, int]:
    """Convert GSM8K- or MATH-style ``.jsonl``/``.parquet`` files into one prompt file.

    Returns ``(rows written, rows skipped)``. An invalid row raises ValueError naming its file
    and row, unless ``skip_invalid`` (then it is counted and logged).
    """
    if kind not in _CONVERTERS:
        raise ValueError(f"unknown dataset kind {kind!r}; expected one of {KINDS}")
    if not inputs:
        raise ValueError("no input files given")
    convert = _CONVERTERS[kind]
    kwargs = {} if data_source is None else {"data_source": data_source}
    records, skipped = [], 0
    for path in inputs:
        rows = read_records(path)
        if not rows:
            raise ValueError(f"input file {str(path)!r} has no rows")
        for row_no, row in enumerate(rows):
            try:
                records.append(convert(row, len(records), split=split, origin=f"{path}:row {row_no}", **kwargs))
            except ValueError as exc:
                if not skip_invalid:
                    raise
                skipped += 1
                logger.warning("skipped: %s", exc)
    if not records:
        raise ValueError(f"no valid rows in {[str(p) for p in inputs]} ({skipped} skipped)")
    return write_records(records, output), skipped


def synthetic_arith_records(
    num: int, seed: int = 0, split: str = "train", partial_credit_scale: float | None = None,
    data_source: str = "synthetic_arith", **problem_kwargs,
) -> list[dict]:
    """Prompt records of the arithmetic task (``make_arith_problems(num, seed, **problem_kwargs)``).

    ``partial_credit_scale`` is stored in ``extra_info`` and turns on the dense reward.
    """
    records = []
    for i, p in enumerate(arithmetic.make_arith_problems(num, seed=seed, **problem_kwargs)):
        extra = {"split": split, "index": i}
        if partial_credit_scale is not None:
            extra["partial_credit_scale"] = float(partial_credit_scale)
        records.append(
            {
                "data_source": data_source,
                "prompt": p.prompt,
                "ability": "arithmetic",
                "reward_model": {"style": "rule", "ground_truth": p.answer},
                "extra_info": extra,
            }
        )
    return records


def write_synthetic_arith(output: str | Path, num: int, seed: int = 0, **kwargs) -> int:
    """Write ``synthetic_arith_records(num, seed, **kwargs)`` to ``output``; the row count."""
    return write_records(synthetic_arith_records(num, seed, **kwargs), output)


def synthetic_chat_records(num: int, seed: int = 0, turns: int = 2, **problem_kwargs) -> list[dict]:
    """Chat records for ``megarl sft``: each row's ``messages`` ask ``turns`` arithmetic questions
    in a row ("3+4=") and hold the assistant's correct answers ("7"), so a tiny model's SFT loss
    has something to learn and a multi-turn conversation to learn it in."""
    problems = arithmetic.make_arith_problems(num * turns, seed=seed, **problem_kwargs)
    records = []
    for i in range(num):
        messages = []
        for p in problems[i * turns:(i + 1) * turns]:
            messages += [{"role": "user", "content": p.prompt}, {"role": "assistant", "content": p.answer}]
        records.append({"messages": messages, "index": i})
    return records


def write_synthetic_chat(output: str | Path, num: int, seed: int = 0, **kwargs) -> int:
    """Write ``synthetic_chat_records(num, seed, **kwargs)`` to ``output``; the row count."""
    return write_records(synthetic_chat_records(num, seed, **kwargs), output)
