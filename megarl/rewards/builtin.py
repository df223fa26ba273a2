"""The built-in rewards, registered under their names with their default data sources.

=================  ==========================================================================
name               data sources
=================  ==========================================================================
``gsm8k``          ``openai/gsm8k``, ``gsm8k`` (``#### N`` required)
``gsm8k_flexible`` -- (``#### N``, else the last number)
``math``           ``math``, ``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``,
                   ``HuggingFaceH4/MATH-500`` (last ``\\boxed{}``, LaTeX-normalised)
``exact_match``    ``exact_match`` (stripped; ``extra_info["case_sensitive"]=False`` ignores case)
``arithmetic``     ``synthetic_arith`` (first integer; ``extra_info["partial_credit_scale"]``
                   turns on dense partial credit)
=================  ==========================================================================
"""

from __future__ import annotations

from megarl.rewards import arithmetic, exact_match, gsm8k, math_answer
from megarl.rewards.registry import register_reward


@register_reward("gsm8k", data_sources=("openai/gsm8k", "gsm8k"), trusted=True)
def gsm8k_reward(*, solution_str, ground_truth, data_source=None, extra_info=None) -> float:
    return gsm8k.compute_score(solution_str, ground_truth, method="strict")


@register_reward("gsm8k_flexible", trusted=True)
def gsm8k_flexible_reward(*, solution_str, ground_truth, data_source=None, extra_info=None) -> float:
    return gsm8k.compute_score(solution_str, ground_truth, method="flexible")


@register_reward(
    "math",
    data_sources=("math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"),
    trusted=True,
)
def math_reward(*, solution_str, ground_truth, data_source=None, extra_info=None) -> float:
    return math_answer.compute_score(solution_str, ground_truth)


@register_reward("exact_match", data_sources=("exact_match",), trusted=True)
def exact_match_reward(*, solution_str, ground_truth, data_source=None, extra_info=None) -> float:
    case_sensitive = bool((extra_info or {}).get("case_sensitive", True))
    return exact_match.compute_score(solution_str, ground_truth, case_sensitive=case_sensitive)


@register_reward("arithmetic", data_sources=("synthetic_arith",), trusted=True)
def arithmetic_reward(*, solution_str, ground_truth, data_source=None, extra_info=None) -> float:
    scale = (extra_info or {}).get("partial_credit_scale")
    return arithmetic.compute_score(solution_str, ground_truth, partial_credit_scale=scale)
