"""The losses a ``MegatronWorker`` trains with, on one micro-batch of response-shaped outputs.

``actor_loss``: the configured policy loss (``megarl.algorithms`` registry, called with the options
it declares), minus the entropy bonus, plus the KL-to-reference term; ``critic_loss``: the clipped
value loss. ``loss_share`` is a micro-batch's share of the mini-batch's aggregated loss: the worker
scales each micro-batch's loss by it so the gradient is that of the loss over the whole mini-batch.
"""

from __future__ import annotations

import dataclasses

import torch

from megarl.algorithms import agg_loss, kl_loss, policy_loss_spec, rollout_mismatch_metrics, value_loss


@dataclasses.dataclass
class LossSettings:
    """The actor's (or critic's) loss: what ``actor`` / ``critic`` config sections say."""

    policy_loss: str = "ppo"
    loss_agg_mode: str = "token-mean"
    max_len: int | None = None  # constant L of seq-mean-token-sum-norm (RunConfig.max_response_length)
    clip_ratio_low: float = 0.2
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = None
    entropy_coef: float = 0.0
    kl_coef: float = 0.0  # > 0: KL-to-reference loss term (needs ref_logp in the batch)
    kl_estimator: str = "k3"
    kl_clamp: float | None = 10.0
    value_clip: float | None = None  # critic
    # (low, high): log the train/rollout mismatch (``actor/mismatch/*``) from this loss's own
    # forward, when the trainer has no recomputed pre-update log-probs to measure it on
    mismatch_bounds: tuple[float, float] | None = None


def loss_share(mode: str, mask: torch.Tensor, counts: dict[str, float]) -> float:
    """This micro-batch's share of the mini-batch's aggregated loss: its tokens over all tokens
    (token-mean), else its non-empty sequences over all non-empty sequences (seq-mean-*)."""
    if mode == "token-mean":
        return float(mask.sum()) / max(counts["tokens"], 1.0)
    return float((mask.sum(-1) > 0).sum()) / max(counts["sequences"], 1.0)


def actor_loss(settings: LossSettings, mb: dict, outputs: dict) -> tuple[torch.Tensor, dict]:
    """The actor's loss on micro-batch ``mb`` given its ``outputs`` (``logp``, ``entropy``), and
    its detached stats. Without ``old_logp`` in ``mb`` (one on-policy pass) the update's own
    log-probs, detached, stand in for them."""
    mask = mb["response_mask"]
    logp = outputs["logp"]
    old_logp = mb["old_logp"] if "old_logp" in mb else logp.detach()
    loss, stats = policy_loss_spec(settings.policy_loss)(
        logp=logp, old_logp=old_logp, advantages=mb.get("advantages"), response_mask=mask,
        loss_agg_mode=settings.loss_agg_mode, max_len=settings.max_len,
        clip_low=settings.clip_ratio_low, clip_high=settings.clip_ratio_high, clip_ratio_c=settings.clip_ratio_c)
    stats = {key: value.detach() for key, value in stats.items()}
    entropy = agg_loss(outputs["entropy"], mask, settings.loss_agg_mode, settings.max_len)
    stats["entropy"] = entropy.detach()
    if settings.entropy_coef:
        loss = loss - settings.entropy_coef * entropy
    if settings.kl_coef:
        kl, kl_stats = kl_loss(logp, mb["ref_logp"], mask, settings.kl_estimator, settings.loss_agg_mode,
                               settings.max_len, clamp=settings.kl_clamp)
        loss = loss + settings.kl_coef * kl
        stats.update({key: value.detach() for key, value in kl_stats.items()})
    if settings.mismatch_bounds is not None and "rollout_logp" in mb:  # the trainer's log-probs vs the engine's
        mismatch = rollout_mismatch_metrics(logp, mb["rollout_logp"], mask, *settings.mismatch_bounds)
        stats.update({f"mismatch/{key}": value for key, value in mismatch.items()})
    stats["loss"] = loss.detach()
    return loss, stats


def critic_loss(settings: LossSettings, mb: dict, outputs: dict) -> tuple[torch.Tensor, dict]:
    """The critic's value loss on micro-batch ``mb`` given its ``outputs`` (``values``), and its
    detached stats."""
    loss, stats = value_loss(values=outputs["values"], old_values=mb["old_values"], returns=mb["returns"],
                             response_mask=mb["response_mask"], clip_range_value=settings.value_clip,
                             loss_agg_mode=settings.loss_agg_mode, max_len=settings.max_len)
    return loss, {key: value.detach() for key, value in stats.items()}
