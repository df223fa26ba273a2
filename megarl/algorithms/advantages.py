"""Advantage estimators over padded ``[batch, response_len]`` batches.

Shapes and conventions:

* ``response_mask`` ``[B, T]`` (float or bool): 1 on real response tokens, 0 on padding. Masks
  may have holes (e.g. tool output inside a multi-turn response); padding is *transparent*:
  returns and GAE bootstrap from the next valid token, and padding neither adds reward nor
  consumes a discount step.
* ``token_rewards`` ``[B, T]``: the outcome score sits on the last response token
  (``scores_to_token_rewards``), plus any per-token terms such as a KL penalty
  (``megarl.algorithms.kl.apply_kl_penalty``). Outcome estimators use the sequence score
  ``score_i = sum_t token_rewards[i, t]`` over valid tokens.
* ``index`` ``[B]``: group id (which prompt a sample was drawn for); an int tensor, or any
  sequence of hashables (e.g. uid strings).
* Every estimator returns ``(advantages, returns)``, both ``[B, T]`` float, broadcast onto the
  response tokens and exactly 0 on padding, computed without gradient.

Edge cases: a group of size 1 has no baseline and gets advantage 0 (GRPO, Dr.GRPO, RLOO,
REINFORCE++-baseline, PRIME); a group whose scores are all equal gets exactly 0 (no division of
rounding noise by a tiny std); rows without response tokens are all 0. Nothing yields NaN.

Estimators (registered names in brackets):

* ``compute_gae_advantage`` [gae] -- Schulman et al. 2016, GAE; used by PPO (Schulman et al. 2017).
* ``compute_grpo_outcome_advantage`` [grpo] -- Shao et al. 2024 (DeepSeekMath), group-normalised.
* ``compute_drgrpo_outcome_advantage`` [drgrpo] -- Liu et al. 2025 (Dr.GRPO): no std division.
* ``compute_rloo_advantage`` [rloo] -- Ahmadian et al. 2024, leave-one-out baseline.
* ``compute_reinforce_plus_plus_advantage`` [reinforce_plus_plus] -- Hu 2025, REINFORCE++.
* ``compute_reinforce_plus_plus_baseline_advantage`` [reinforce_plus_plus_baseline] -- Hu 2025.
* ``compute_remax_advantage`` [remax] -- Li et al. 2023, ReMax (greedy-rollout baseline).
* ``compute_prime_advantage`` [prime] -- Cui et al. 2025, PRIME implicit process rewards + RLOO.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

import torch

from megarl.algorithms.aggregation import masked_mean, masked_sum, masked_whiten
from megarl.algorithms.registry import register_advantage

# ----------------------------------------------------------------------------- helpers


def _as_float(x: torch.Tensor) -> torch.Tensor:
    """fp64 stays fp64; everything else (bf16, fp16, ints, bool) is computed in fp32."""
    return x if x.dtype == torch.float64 else x.float()


def _mask(response_mask: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [batch, response_len], got shape {tuple(response_mask.shape)}")
    if like is not None and like.shape != response_mask.shape:
        raise ValueError(f"tensor shape {tuple(like.shape)} does not match response_mask {tuple(response_mask.shape)}")
    return response_mask.bool()


def _valid(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``x`` as float with padding positions replaced by 0 (never multiplied: NaN-safe)."""
    x = _as_float(x)
    return torch.where(m, x, x.new_zeros(()))


def _broadcast(per_seq: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``[B]`` -> ``[B, T]`` on response tokens, 0 on padding."""
    return torch.where(m, per_seq[:, None], per_seq.new_zeros(()))


def sequence_scores(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``score_i = sum_t token_rewards[i, t]`` over response tokens ``[B]`` (0 for empty rows)."""
    m = _mask(response_mask, token_rewards)
    return masked_sum(_as_float(token_rewards), m, dim=-1)


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence score ``[B]`` on its last response token ``[B, T]``; 0 elsewhere.

    A row without response tokens has nowhere to put its score and stays all 0.
    """
    m = _mask(response_mask)
    scores = _as_float(scores)
    T = m.shape[-1]
    positions = torch.arange(T, device=m.device).expand_as(m)
    last = torch.where(m, positions, torch.full_like(positions, -1)).amax(dim=-1)
    out = torch.zeros(m.shape, dtype=scores.dtype, device=scores.device)
    has = last >= 0
    rows = torch.nonzero(has, as_tuple=True)[0]
    out[rows, last[rows]] = scores[rows]
    return out


def discounted_returns(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Return-to-go ``G_t = sum_{s >= t, s valid} gamma^(#valid tokens between t and s) r_s``.

    Padding is transparent (does not consume a discount step); padding positions of the result
    are 0. ``gamma == 1`` takes a reverse-cumsum fast path.
    """
    m = _mask(response_mask, token_rewards)
    r = _valid(token_rewards, m)
    if gamma == 1.0:
        returns = r.flip(-1).cumsum(-1).flip(-1)
        return torch.where(m, returns, returns.new_zeros(()))
    returns = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[-1])):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        returns[:, t] = torch.where(m[:, t], running, running.new_zeros(()))
    return returns


def _group_ids(index: torch.Tensor | Sequence[Hashable], batch: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Dense group ids ``0..G-1`` for ``index`` (int tensor or a sequence of hashables)."""
    if isinstance(index, torch.Tensor):
        if index.dim() != 1 or index.shape[0] != batch:
            raise ValueError(f"index must be a [batch={batch}] tensor, got shape {tuple(index.shape)}")
        if index.is_floating_point():
            raise ValueError("index must hold integer group ids, got a floating-point tensor")
        uniq, inverse = torch.unique(index, return_inverse=True)
        return inverse.to(device), int(uniq.numel())
    index = list(index)
    if len(index) != batch:
        raise ValueError(f"index has {len(index)} entries for a batch of {batch}")
    ids: dict[Hashable, int] = {}
    inverse = torch.tensor([ids.setdefault(k, len(ids)) for k in index], dtype=torch.long, device=device)
    return inverse, len(ids)


@dataclasses.dataclass(frozen=True)
class GroupStats:
    """Per-sample statistics of the sample's group, each ``[B]``."""

    size: torch.Tensor  # number of samples in the group (float)
    mean: torch.Tensor  # group mean score
    std: torch.Tensor  # unbiased (n - 1) standard deviation; 0 for groups of size 1
    all_equal: torch.Tensor  # bool: every score in the group is identical (always true for size 1)


def group_stats(scores: torch.Tensor, index: torch.Tensor | Sequence[Hashable]) -> GroupStats:
    """Group size, mean, unbiased std and "all scores equal" of each sample's group."""
    scores = _as_float(scores)
    if scores.dim() != 1:
        raise ValueError(f"scores must be [batch], got shape {tuple(scores.shape)}")
    inv, n = _group_ids(index, scores.shape[0], scores.device)
    zeros = scores.new_zeros(n)
    count = zeros.index_add(0, inv, torch.ones_like(scores))
    mean = zeros.index_add(0, inv, scores) / count.clamp(min=1)
    sq = zeros.index_add(0, inv, (scores - mean[inv]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    gmax = zeros.scatter_reduce(0, inv, scores, "amax", include_self=False)
    gmin = zeros.scatter_reduce(0, inv, scores, "amin", include_self=False)
    return GroupStats(size=count[inv], mean=mean[inv], std=std[inv], all_equal=(gmax == gmin)[inv])


# ----------------------------------------------------------------------------- estimators


@register_advantage("gae", inputs=("values", "gamma", "lam"), needs_critic=True)
@torch.no_grad()
def compute_gae_advantage(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016), the PPO critic-based estimator.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``,
    where ``t+1`` is the next *valid* token (padding is skipped) and ``V`` after the last
    response token is 0 (the episode ends there). ``returns = A + V`` (the critic's regression
    target, computed before whitening). With ``whiten`` the advantages are whitened over all
    valid tokens of the batch, as PPO implementations do.
    """
    m = _mask(response_mask, token_rewards)
    _mask(response_mask, values)
    r = _valid(token_rewards, m)
    v = _valid(values, m)
    advantages = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    last_gae = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[-1])):
        mt = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        gae = delta + gamma * lam * last_gae
        advantages[:, t] = torch.where(mt, gae, gae.new_zeros(()))
        next_value = torch.where(mt, v[:, t], next_value)
        last_gae = torch.where(mt, gae, last_gae)
    returns = torch.where(m, advantages + v, v.new_zeros(()))
    if whiten:
        advantages = masked_whiten(advantages, m)
    return advantages, returns


@register_advantage("grpo", inputs=("index", "norm_by_std"), needs_groups=True)
@torch.no_grad()
def compute_grpo_outcome_advantage(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor | Sequence[Hashable],
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath, section 4.1.2).

    ``A_i = (r_i - mean_g(r)) / (std_g(r) + epsilon)`` with the group's unbiased std, broadcast
    to every response token of sample ``i``. ``norm_by_std=False`` gives Dr.GRPO's
    ``A_i = r_i - mean_g(r)`` (Liu et al. 2025). Groups of size 1 and groups whose scores are
    all equal get exactly 0. ``returns`` equals ``advantages``.
    """
    m = _mask(response_mask, token_rewards)
    scores = sequence_scores(token_rewards, m)
    st = group_stats(scores, index)
    adv = scores - st.mean
    if norm_by_std:
        adv = adv / (st.std + epsilon)
    adv = torch.where(st.all_equal, adv.new_zeros(()), adv)
    out = _broadcast(adv, m)
    return out, out


@register_advantage("drgrpo", inputs=("index",), needs_groups=True)
@torch.no_grad()
def compute_drgrpo_outcome_advantage(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor | Sequence[Hashable],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO advantage (Liu et al. 2025): ``A_i = r_i - mean_g(r)``, no std division.

    Pair it with ``loss_agg_mode="seq-mean-token-sum-norm"`` for the full Dr.GRPO objective.
    """
    return compute_grpo_outcome_advantage(
        token_rewards=token_rewards, response_mask=response_mask, index=index, norm_by_std=False
    )


@register_advantage("rloo", inputs=("index",), needs_groups=True)
@torch.no_grad()
def compute_rloo_advantage(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor | Sequence[Hashable],
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019).

    ``A_i = r_i - 1/(K-1) sum_{j != i} r_j = K/(K-1) (r_i - mean_g(r))`` for a group of ``K``
    samples; groups of size 1 (no other sample to form a baseline) get 0.
    """
    m = _mask(response_mask, token_rewards)
    scores = sequence_scores(token_rewards, m)
    st = group_stats(scores, index)
    adv = st.size / (st.size - 1).clamp(min=1) * (scores - st.mean)
    adv = torch.where(st.all_equal, adv.new_zeros(()), adv)
    out = _broadcast(adv, m)
    return out, out


@register_advantage("reinforce_plus_plus", inputs=("gamma",))
@torch.no_grad()
def compute_reinforce_plus_plus_advantage(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted return of token rewards, then batch-global whitening.

    ``token_rewards`` should already carry the per-token KL penalty
    (``r_t = 1[t = last] * score - beta * KL_t``, see ``apply_kl_penalty``).
    ``G_t = sum_{s >= t} gamma^(s-t) r_s`` and ``A = (G - mean(G)) / std(G)`` with mean and std
    over every valid token of the batch. ``returns`` are the unwhitened ``G``.
    """
    m = _mask(response_mask, token_rewards)
    returns = discounted_returns(token_rewards, m, gamma)
    return masked_whiten(returns, m), returns


@register_advantage("reinforce_plus_plus_baseline", inputs=("index",), needs_groups=True)
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_advantage(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor | Sequence[Hashable],
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025): subtract the group mean, then whiten batch-globally.

    ``A'_i = r_i - mean_g(r)`` broadcast to the response tokens, then
    ``A = (A' - mean(A')) / std(A')`` over valid tokens (token-weighted, as in the paper's
    global batch normalisation). Samples of size-1 groups carry no baseline-corrected signal:
    they get 0 and are left out of the whitening statistics. The KL term is meant to be a loss
    (``kl_loss`` with k3), not a reward penalty. ``returns`` are the unwhitened ``A'``.
    """
    m = _mask(response_mask, token_rewards)
    scores = sequence_scores(token_rewards, m)
    st = group_stats(scores, index)
    centred = torch.where(st.all_equal, scores.new_zeros(()), scores - st.mean)
    returns = _broadcast(centred, m)
    keep = m & (st.size > 1)[:, None]
    return masked_whiten(returns, keep), returns


@register_advantage("remax", inputs=("baseline_rewards",))
@torch.no_grad()
def compute_remax_advantage(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    baseline_rewards: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): REINFORCE with the greedy response's reward as the baseline.

    ``A_t = G_t - b`` with ``G_t = sum_{s >= t} r_s`` (undiscounted return-to-go of the token
    rewards) and ``b`` ``[B]`` the reward of the greedy (argmax-decoded) response to the same
    prompt. With the score on the last token only, ``A_t = r(x, y) - r(x, y_greedy)``.
    ``returns`` are ``G``.
    """
    m = _mask(response_mask, token_rewards)
    returns = discounted_returns(token_rewards, m, 1.0)
    baseline = _as_float(baseline_rewards)
    if baseline.shape != (m.shape[0],):
        raise ValueError(f"baseline_rewards must be [batch={m.shape[0]}], got shape {tuple(baseline.shape)}")
    adv = torch.where(m, returns - baseline[:, None], returns.new_zeros(()))
    return adv, returns


def implicit_process_rewards(
    prm_logp: torch.Tensor, ref_logp: torch.Tensor, response_mask: torch.Tensor, beta: float
) -> torch.Tensor:
    """PRIME's implicit process reward (Cui et al. 2025; Yuan et al. 2024, "Free Process Rewards").

    ``r_phi(y_t) = beta * log(pi_phi(y_t | y_<t) / pi_ref(y_t | y_<t))`` per token, from the
    implicit PRM's and the reference model's token log-probs; 0 on padding. No gradient.
    """
    m = _mask(response_mask, prm_logp)
    with torch.no_grad():
        return _valid(beta * (_as_float(prm_logp) - _as_float(ref_logp)), m)


@register_advantage("prime", inputs=("index", "process_rewards", "gamma"), needs_groups=True)
@torch.no_grad()
def compute_prime_advantage(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor | Sequence[Hashable],
    process_rewards: torch.Tensor,
    gamma: float = 1.0,
    process_coef: float = 1.0,
    outcome_coef: float = 1.0,
    whiten: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PRIME advantage (Cui et al. 2025, "Process Reinforcement through Implicit Rewards", eq. 5).

    RLOO is applied to the process and the outcome rewards separately, then summed::

        A_t^i = process_coef * sum_{s >= t} gamma^(s-t) [ r_phi(y_s^i) - 1/(K-1) sum_{j != i} rbar_j ]
              + outcome_coef * ( r_o(y^i) - 1/(K-1) sum_{j != i} r_o(y^j) )

    ``process_rewards`` ``[B, T]`` are the token-level process rewards (the hook: use
    ``implicit_process_rewards`` for PRIME's ``beta * log(pi_phi / pi_ref)``, or any dense
    reward); ``rbar_j`` is the mean process reward over sample ``j``'s response tokens (0 for an
    empty response); ``r_o`` are the outcome scores ``sum_t token_rewards``. Groups of size 1
    get 0. ``returns`` are the unwhitened advantages; ``whiten=True`` additionally whitens over
    the batch as PRIME's reference code does.
    """
    m = _mask(response_mask, token_rewards)
    _mask(response_mask, process_rewards)
    p = _valid(process_rewards, m)
    rbar = masked_mean(p, m, dim=-1)
    st_p = group_stats(rbar, index)
    k_minus_1 = (st_p.size - 1).clamp(min=1)
    loo_process = (st_p.size * st_p.mean - rbar) / k_minus_1
    process_adv = discounted_returns(p - loo_process[:, None], m, gamma)

    scores = sequence_scores(token_rewards, m)
    st_o = group_stats(scores, index)
    outcome_adv = st_o.size / k_minus_1 * (scores - st_o.mean)
    outcome_adv = torch.where(st_o.all_equal, outcome_adv.new_zeros(()), outcome_adv)

    keep = m & (st_p.size > 1)[:, None]
    adv = process_coef * process_adv + outcome_coef * outcome_adv[:, None]
    adv = torch.where(keep, adv, adv.new_zeros(()))
    if whiten:
        return masked_whiten(adv, keep), adv
    return adv, adv
