"""Exact-match scoring: the response, stripped, equals the reference (optionally ignoring case).

For tasks with one canonical short answer (labels, names, single words) where any notation
normalisation would be wrong.
"""

from __future__ import annotations


def compute_score(solution_str: str, ground_truth: str, case_sensitive: bool = True) -> float:
    """1.0 if ``solution_str.strip() == ground_truth.strip()`` (casefolded unless ``case_sensitive``)."""
    a, b = str(solution_str).strip(), str(ground_truth).strip()
    if not case_sensitive:
        a, b = a.casefold(), b.casefold()
    return 1.0 if a == b else 0.0
