"""Policy losses, the value loss and entropy, over padded ``[batch, response_len]`` batches.

Every policy loss is called by keyword, ``fn(*, logp, old_logp, advantages, response_mask,
loss_agg_mode, max_len, <hyper-parameters>)``, and returns ``(loss, metrics)``: a scalar loss to
minimise and a dict of detached scalar tensors (call ``.item()`` when logging). ``logp`` is the
current policy's log-prob of each sampled token (carries the gradient), ``old_logp`` the
behaviour policy's (rollout-time) log-prob, ``advantages`` ``[B, T]``. ``old_logp`` and
``advantages`` are treated as constants. Values on padding positions are never read (a NaN
there does not propagate). ``loss_agg_mode`` is one of
``megarl.algorithms.aggregation.LOSS_AGG_MODES``; ``max_len`` is the Dr.GRPO constant.
"""

from __future__ import annotations

import torch

from megarl.algorithms.aggregation import agg_loss, masked_mean
from megarl.algorithms.registry import register_policy_loss

# Bound on |log ratio| before exponentiating, so one stale token cannot overflow the ratio
# (verl clamps to the same range). Far outside any clip range, so it never changes a clipped loss.
_MAX_LOG_RATIO = 20.0


def _check(logp: torch.Tensor, response_mask: torch.Tensor, **others: torch.Tensor | None) -> torch.Tensor:
    if logp.dim() != 2:
        raise ValueError(f"logp must be [batch, response_len], got shape {tuple(logp.shape)}")
    for name, t in {"response_mask": response_mask, **others}.items():
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match logp shape {tuple(logp.shape)}")
    return response_mask.bool()


def _zero_pad(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, x, x.new_zeros(()))


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """Ratios and losses are computed in fp32 (fp64 stays fp64); bf16 log-prob differences are too coarse."""
    return x if x.dtype == torch.float64 else x.float()


def _approx_kl_metrics(log_ratio: torch.Tensor, m: torch.Tensor) -> dict[str, torch.Tensor]:
    """KL(pi_old || pi) on tokens sampled from pi_old, ``log_ratio = logp - old_logp``:
    ``ppo_kl`` is the k1 estimate ``-log_ratio``, ``approx_kl`` the k3 ``(r - 1) - log r``."""
    log_ratio = log_ratio.detach()
    return {
        "ppo_kl": masked_mean(-log_ratio, m),
        "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, m),
    }


@register_policy_loss("ppo", options=("clip_low", "clip_high", "clip_ratio_c"))
def ppo_policy_loss(
    *,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    max_len: int | None = None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with clip-higher and dual-clip.

    Per token, with ``rho = exp(logp - old_logp)``::

        l = max(-A * rho, -A * clip(rho, 1 - clip_low, 1 + clip_high))

    ``clip_high`` defaults to ``clip_low`` (symmetric PPO); DAPO's clip-higher (Yu et al. 2025)
    uses e.g. ``clip_low=0.2, clip_high=0.28``. Dual-clip (Ye et al. 2020, "Mastering Complex
    Control in MOBA Games"), enabled by ``clip_ratio_c > 1`` (typically 3): for ``A < 0`` the
    loss is further bounded, ``l = min(l, -A * clip_ratio_c)``, so a very large ratio on a
    negative-advantage token cannot blow up the update. Clipped tokens have zero gradient.

    Metrics: ``pg_loss``; ``clipfrac`` (fraction of tokens where the clip is active);
    ``clipfrac_dual`` (tokens bounded by the dual clip); ``ppo_kl`` and ``approx_kl`` (k1 and
    k3 estimates of KL(pi_old || pi)); ``ratio_mean``.
    """
    clip_high = clip_low if clip_high is None else clip_high
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1, got {clip_ratio_c}")
    m = _check(logp, response_mask, old_logp=old_logp, advantages=advantages)
    logp, old_logp = _fp32(logp), _fp32(old_logp)
    log_ratio = _zero_pad(logp - old_logp.detach(), m).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    adv = _zero_pad(advantages.detach().to(ratio.dtype), m)

    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_tok = torch.maximum(pg_unclipped, pg_clipped)
    clip_active = pg_clipped > pg_unclipped
    if clip_ratio_c is not None:
        pg_dual = -adv * clip_ratio_c
        dual_active = (adv < 0) & (loss_tok > pg_dual)
        loss_tok = torch.where(adv < 0, torch.minimum(loss_tok, pg_dual), loss_tok)
    else:
        dual_active = torch.zeros_like(m)

    loss = agg_loss(loss_tok, m, loss_agg_mode, max_len)
    metrics = {
        "pg_loss": loss.detach(),
        "clipfrac": masked_mean(clip_active.to(ratio.dtype), m),
        "clipfrac_dual": masked_mean(dual_active.to(ratio.dtype), m),
        "ratio_mean": masked_mean(ratio.detach(), m),
        **_approx_kl_metrics(log_ratio, m),
    }
    return loss, metrics


@register_policy_loss("gspo", options=("clip_low", "clip_high"))
def gspo_policy_loss(
    *,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    max_len: int | None = None,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO, Group Sequence Policy Optimization (Zheng et al. 2025), in its GSPO-token form.

    Sequence-level, length-normalised importance ratio (GSPO eq. 7)::

        s_i = (pi(y_i) / pi_old(y_i)) ^ (1/|y_i|) = exp( 1/|y_i| sum_t log(pi(y_i,t) / pi_old(y_i,t)) )

    and the token form (eq. 13) ``s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)]``, whose value is
    ``s_i`` and whose gradient is ``s_i * grad log pi(y_i,t)``. Per token
    ``l = max(-A * s_i,t, -A * clip(s_i,t, 1 - clip_low, 1 + clip_high))``; with the default
    ``"seq-mean-token-mean"`` aggregation and a per-sequence advantage this is exactly GSPO's
    sequence objective ``-1/G sum_i min(s_i A_i, clip(s_i) A_i)`` in value and gradient. The
    clip range is tiny (paper: 3e-4 / 4e-4) because ``s_i`` is a geometric mean. Token-level
    advantages ``A_i,t`` are allowed (the reason for the token form).

    Metrics: ``pg_loss``, ``clipfrac`` (token-weighted fraction of clipped sequences),
    ``seq_ratio_mean`` (mean ``s_i`` over non-empty sequences), ``ppo_kl``, ``approx_kl``.
    """
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    m = _check(logp, response_mask, old_logp=old_logp, advantages=advantages)
    logp, old_logp = _fp32(logp), _fp32(old_logp)
    log_ratio = _zero_pad(logp - old_logp.detach(), m)
    seq_log_ratio = masked_mean(log_ratio, m, dim=-1)  # log s_i, 0 for empty rows
    logp_valid = _zero_pad(logp, m)
    log_s_tok = seq_log_ratio.detach()[:, None] + logp_valid - logp_valid.detach()
    ratio = torch.exp(log_s_tok.clamp(max=_MAX_LOG_RATIO))
    adv = _zero_pad(advantages.detach().to(ratio.dtype), m)

    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_tok = torch.maximum(pg_unclipped, pg_clipped)
    loss = agg_loss(loss_tok, m, loss_agg_mode, max_len)
    metrics = {
        "pg_loss": loss.detach(),
        "clipfrac": masked_mean((pg_clipped > pg_unclipped).to(ratio.dtype), m),
        "seq_ratio_mean": masked_mean(seq_log_ratio.detach().exp(), m.any(dim=-1)),
        **_approx_kl_metrics(log_ratio, m),
    }
    return loss, metrics


@register_policy_loss("vanilla")
def vanilla_policy_loss(
    *,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    old_logp: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain policy gradient (REINFORCE, Williams 1992): per token ``l = -A * logp``.

    Strictly on-policy (no ratio, no clipping). ``old_logp`` is optional and only feeds the
    ``ppo_kl`` / ``approx_kl`` metrics.
    """
    m = _check(logp, response_mask, advantages=advantages, old_logp=old_logp)
    logp = _fp32(logp)
    adv = _zero_pad(advantages.detach().to(logp.dtype), m)
    loss_tok = -adv * _zero_pad(logp, m)
    loss = agg_loss(loss_tok, m, loss_agg_mode, max_len)
    metrics = {"pg_loss": loss.detach()}
    if old_logp is not None:
        metrics.update(_approx_kl_metrics(_zero_pad(logp - _fp32(old_logp), m), m))
    return loss, metrics


@register_policy_loss("sft")
def sft_loss(
    *,
    logp: torch.Tensor,
    response_mask: torch.Tensor,
    advantages: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Supervised fine-tuning (``megarl sft``): the negative log-likelihood of the masked tokens,
    per token ``l = -logp`` (with token-mean: HF's masked cross-entropy). Advantages and old
    log-probs are not used. Metric: ``nll``."""
    m = _check(logp, response_mask)
    loss = agg_loss(-_zero_pad(_fp32(logp), m), m, loss_agg_mode, max_len)
    return loss, {"nll": loss.detach()}


def value_loss(
    *,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range_value: float | None = 0.2,
    loss_agg_mode: str = "token-mean",
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped value loss (Schulman et al. 2017; the OpenAI baselines ppo2 form).

    ``V_clip = V_old + clip(V - V_old, -c, c)`` and per token
    ``l = 0.5 * max((V - R)^2, (V_clip - R)^2)``; ``clip_range_value=None`` gives the plain
    ``0.5 * (V - R)^2``. Metrics: ``vf_loss``, ``vf_clipfrac`` (tokens where the clipped term is
    the larger), ``vpred_mean``.
    """
    m = _check(values, response_mask, old_values=old_values, returns=returns)
    v = _zero_pad(_fp32(values), m)
    v_old = _zero_pad(old_values.detach().to(v.dtype), m)
    ret = _zero_pad(returns.detach().to(v.dtype), m)
    unclipped = (v - ret) ** 2
    if clip_range_value is None:
        loss_tok = 0.5 * unclipped
        clipfrac = torch.zeros((), dtype=v.dtype, device=v.device)
    else:
        if clip_range_value < 0:
            raise ValueError(f"clip_range_value must be >= 0 or None, got {clip_range_value}")
        v_clipped = v_old + (v - v_old).clamp(-clip_range_value, clip_range_value)
        clipped = (v_clipped - ret) ** 2
        loss_tok = 0.5 * torch.maximum(unclipped, clipped)
        clipfrac = masked_mean((clipped > unclipped).to(v.dtype), m)
    loss = agg_loss(loss_tok, m, loss_agg_mode, max_len)
    return loss, {"vf_loss": loss.detach(), "vf_clipfrac": clipfrac, "vpred_mean": masked_mean(v.detach(), m)}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy ``H = logsumexp(z) - sum_v softmax(z)_v z_v`` of each categorical, ``[..., V] -> [...]``.

    Computed in fp32 (or fp64). Vocabulary entries masked with ``-inf`` contribute 0 and give
    finite gradients. (Full-vocabulary form; a tensor-parallel model needs the vocab-parallel
    reduction instead.)
    """
    z = logits if logits.dtype == torch.float64 else logits.float()
    p = torch.softmax(z, dim=-1)
    z_finite = torch.where(torch.isfinite(z), z, z.new_zeros(()))
    return torch.logsumexp(z, dim=-1) - (p * z_finite).sum(dim=-1)


def masked_entropy(
    logits: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    max_len: int | None = None,
) -> torch.Tensor:
    """Aggregated entropy of the response tokens (default: mean over masked tokens).

    ``logits`` ``[B, T, V]`` are the policy's logits at the response positions. Differentiable:
    an entropy bonus is ``loss = pg_loss - coef * masked_entropy(...)``.
    """
    if logits.dim() != 3 or logits.shape[:2] != response_mask.shape:
        raise ValueError(
            f"logits must be [batch, response_len, vocab] matching response_mask {tuple(response_mask.shape)}, "
            f"got {tuple(logits.shape)}"
        )
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode, max_len)
