"""Rollout correction: importance weights for the gap between the policy that sampled a batch and
the policy its update starts from, and the metrics of that gap.

The rollout engine samples with other kernels than the trainer (and, off-policy, with older
weights), so its log-probs ``rollout_logp`` differ from the actor's pre-update ``old_logp`` (PPO's
proximal policy). With ``r = exp(old_logp - rollout_logp)`` per token, a correction gives weights
``w >= 0`` that multiply the advantages. For ``w >= 0``, PPO's objective with ``w * A`` is ``w``
times the objective with ``A`` (a positive factor commutes with its min, max and clip), so every
registered policy loss takes them unchanged; with ``old_logp`` recomputed by the actor this is
decoupled PPO (Hilton et al. 2021). Built-ins, ``R = exp(sum_t log r_t)`` over a sequence:

    tis       w = min(r, high)                   truncated IS, per token (Yao et al. 2025, "TIS")
    seq_tis   w = min(R, high)                   truncated IS, per sequence
    mis       w = r * [r <= high]                masked IS, per token (tokens over the cap get 0)
    seq_mis   w = R * [R <= high]                masked IS, per sequence
    icepop    w = r * [low <= r <= high]         IcePop (Ring-1T): two-sided token mask

``register_rollout_correction`` adds your own. Weights are detached and 0 on padding; log-ratios
are clamped to +-20 before exponentiating (one stale token must not overflow a sequence's ratio).
"""

from __future__ import annotations

import torch

from megarl.algorithms.aggregation import masked_mean
from megarl.algorithms.registry import register_rollout_correction, rollout_correction_spec

_MAX_LOG_RATIO = 20.0


def _sequence_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's summed log-ratio, broadcast over its tokens."""
    m = response_mask.bool()
    total = torch.where(m, log_ratio, log_ratio.new_zeros(())).sum(-1, keepdim=True)
    return total.expand_as(log_ratio)


@register_rollout_correction("tis")
def truncated_is(*, log_ratio, response_mask, low, high):
    return log_ratio.clamp(max=_MAX_LOG_RATIO).exp().clamp(max=high)


@register_rollout_correction("mis")
def masked_is(*, log_ratio, response_mask, low, high):
    ratio = log_ratio.clamp(max=_MAX_LOG_RATIO).exp()
    return torch.where(ratio <= high, ratio, ratio.new_zeros(()))


@register_rollout_correction("icepop")
def icepop(*, log_ratio, response_mask, low, high):
    ratio = log_ratio.clamp(max=_MAX_LOG_RATIO).exp()
    return torch.where((ratio >= low) & (ratio <= high), ratio, ratio.new_zeros(()))


def _per_sequence(token_level):
    """The sequence-level form of a token-level correction: applied to each sequence's summed
    log-ratio, the same weight on all its tokens."""

    def correction(*, log_ratio, response_mask, low, high):
        return token_level(log_ratio=_sequence_log_ratio(log_ratio, response_mask), response_mask=response_mask,
                           low=low, high=high)

    return correction


register_rollout_correction("seq_tis")(_per_sequence(truncated_is))
register_rollout_correction("seq_mis")(_per_sequence(masked_is))


def rollout_correction_weights(method: str, old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                               response_mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Weights [B, T] of the registered correction ``method`` (detached, fp32, 0 on padding)."""
    if old_logp.shape != rollout_logp.shape or old_logp.shape != response_mask.shape:
        raise ValueError(f"old_logp {tuple(old_logp.shape)}, rollout_logp {tuple(rollout_logp.shape)} and "
                         f"response_mask {tuple(response_mask.shape)} must have one shape")
    m = response_mask.bool()
    log_ratio = torch.where(m, old_logp.detach().float() - rollout_logp.detach().float(), 0.0)
    weights = rollout_correction_spec(method)(log_ratio=log_ratio, response_mask=m, low=low, high=high)
    return torch.where(m, weights, weights.new_zeros(()))


def rollout_mismatch_metrics(train_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor,
                             low: float, high: float) -> dict[str, torch.Tensor]:
    """How far the trainer's log-probs of the sampled tokens are from the engine's, over the
    response tokens: ``abs_logp_diff`` mean |logp_train - logp_rollout|; ``kl_k3`` the k3
    estimate of KL(rollout || train) on the rollout's own samples, ``r - 1 - log r`` with
    ``r = p_train / p_rollout``; ``ppl_ratio`` the training policy's perplexity of the responses
    over the rollout's, ``exp(mean(logp_rollout - logp_train))``; ``outside_bounds`` the fraction
    of tokens with ``r`` outside [low, high]."""
    m = response_mask.bool()
    log_ratio = torch.where(m, train_logp.detach().float() - rollout_logp.detach().float(), 0.0)
    ratio = log_ratio.clamp(max=_MAX_LOG_RATIO).exp()
    return {
        "abs_logp_diff": masked_mean(log_ratio.abs(), m),
        "kl_k3": masked_mean(ratio - 1 - log_ratio, m),
        "ppl_ratio": masked_mean(-log_ratio, m).exp(),
        "outside_bounds": masked_mean(((ratio < low) | (ratio > high)).float(), m),
    }
