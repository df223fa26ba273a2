"""Masked reductions and loss aggregation over padded ``[batch, response_len]`` tensors.

Every function here takes a ``response_mask`` (float or bool, 1/True on real response tokens)
and never lets values on padding positions leak into the result: padding is selected away with
``torch.where`` rather than multiplied by zero, so a NaN or inf sitting on a padding position
(uninitialised log-probs, a ``-inf`` logit) cannot turn the result into NaN.

Loss aggregation modes (``loss_agg_mode``), for a per-token loss ``l[i, t]`` and mask ``m[i, t]``:

``"token-mean"``
    ``sum_{i,t} m l / sum_{i,t} m`` -- every token of the batch weighs the same
    (DAPO, Yu et al. 2025, "token-level policy gradient loss").
``"seq-mean-token-sum"``
    ``mean_i sum_t m l`` -- each sequence contributes its summed loss.
``"seq-mean-token-mean"``
    ``mean_i (sum_t m l / sum_t m)`` -- the original GRPO objective (Shao et al. 2024), where each
    sequence is averaged over its own length first.
``"seq-mean-token-sum-norm"``
    ``mean_i (sum_t m l) / L`` with a constant ``L`` (``max_len``, default the padded response
    length): Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"), which removes the
    per-sequence length normalisation that biases GRPO towards long wrong answers.

In the three ``seq-mean-*`` modes the mean over sequences runs over rows with at least one
response token; rows that are all padding (e.g. filler rows added to balance data-parallel
ranks) neither contribute nor dilute the mean. A batch without any response token gives 0.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _bool_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    mask = mask.bool() if mask.dtype != torch.bool else mask
    if mask.shape != like.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match values shape {tuple(like.shape)}")
    return mask


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(values * mask)`` over ``dim`` (all elements if None); padding values are ignored."""
    m = _bool_mask(mask, values)
    zeroed = torch.where(m, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return zeroed.sum() if dim is None else zeroed.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(values * mask) / sum(mask)`` over ``dim``; 0 (not NaN) where the mask is empty."""
    m = _bool_mask(mask, values)
    total = masked_sum(values, m, dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked elements (all dims). Unbiased (Bessel, ``n - 1``) by default.

    Fewer than two valid elements give 0 rather than NaN.
    """
    m = _bool_mask(mask, values)
    mean = masked_mean(values, m)
    sq = masked_sum((values - mean) ** 2, m)
    n = m.sum()
    denom = (n - 1) if unbiased else n
    return sq / denom.clamp(min=1).to(sq.dtype)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Batch-global whitening ``(x - mean) / sqrt(var + eps)`` over the masked elements.

    Statistics are taken over every valid token of the whole batch (unbiased variance). With
    ``shift_mean=False`` the mean is added back (only the scale is normalised). Padding
    positions of the result are 0.
    """
    m = _bool_mask(mask, values)
    mean = masked_mean(values, m)
    var = masked_var(values, m)
    out = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, torch.zeros((), dtype=out.dtype, device=out.device))


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    max_len: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[batch, response_len]`` to a scalar (see the module docstring).

    ``max_len`` is the constant length ``L`` of ``"seq-mean-token-sum-norm"`` (Dr.GRPO); it
    defaults to ``loss_mat.shape[-1]``. Set it to the generation's max response length so the
    loss scale does not depend on how a batch happened to be padded.
    """
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be [batch, response_len], got shape {tuple(loss_mat.shape)}")
    m = _bool_mask(loss_mask, loss_mat)
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, m)
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {list(LOSS_AGG_MODES)}")
    seq_valid = m.any(dim=-1)
    seq_sum = masked_sum(loss_mat, m, dim=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        per_seq = seq_sum
    elif loss_agg_mode == "seq-mean-token-mean":
        per_seq = seq_sum / m.sum(dim=-1).clamp(min=1).to(seq_sum.dtype)
    else:  # seq-mean-token-sum-norm
        norm = loss_mat.shape[-1] if max_len is None else max_len
        if norm <= 0:
            raise ValueError(f"max_len must be positive for seq-mean-token-sum-norm, got {norm}")
        per_seq = seq_sum / norm
    return masked_mean(per_seq, seq_valid)
