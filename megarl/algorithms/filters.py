"""DAPO's sample filters and reward shaping (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale").
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from megarl.algorithms.advantages import group_stats


def dynamic_sampling_mask(scores: torch.Tensor, index: torch.Tensor | Sequence[Hashable]) -> torch.Tensor:
    """DAPO dynamic sampling: keep-mask ``[B]`` (bool) of samples whose group is informative.

    DAPO over-samples and drops prompts whose group is all-correct or all-wrong
    (``0 < |{o_i : correct}| < G``, eq. 11): their group-relative advantage is 0, so they only
    shrink the effective batch. Generalised to any score: a group is kept iff its scores are
    not all equal. A group of size 1 is therefore dropped.
    """
    return ~group_stats(scores, index).all_equal


def response_lengths(response_mask: torch.Tensor) -> torch.Tensor:
    """Number of response tokens per row ``[B]`` (long)."""
    return response_mask.bool().sum(dim=-1)


def overlong_reward_penalty(
    response_lengths: torch.Tensor, max_len: int, cache_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment (eq. 13), a length-dependent reward added to the score::

        R(L) = 0                                  if L <= max_len - cache_len
             = ((max_len - cache_len) - L) / cache_len   if max_len - cache_len < L <= max_len
             = -1                                 if L > max_len

    i.e. 0 up to the start of the cache window, falling linearly to -1 at ``max_len``, -1
    beyond, all times ``penalty_factor``. Returns float ``[B]``. (DAPO used max_len=20480,
    cache_len=4096.)
    """
    if max_len <= 0 or not 0 <= cache_len <= max_len:
        raise ValueError(
            f"need max_len > 0 and 0 <= cache_len <= max_len, got max_len={max_len}, cache_len={cache_len}"
        )
    length = response_lengths.to(torch.float64 if response_lengths.dtype == torch.float64 else torch.float32)
    start = max_len - cache_len
    ramp = (start - length) / max(cache_len, 1)
    penalty = torch.where(length <= max_len, ramp, -torch.ones_like(length))
    penalty = torch.where(length <= start, torch.zeros_like(length), penalty)
    return penalty * penalty_factor
