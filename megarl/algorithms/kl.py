"""Per-token KL estimators between the policy and a reference, and KL coefficient controllers.

Tokens are sampled from the policy ``pi``; with ``log_r = ref_logp - logp`` (the log of
``r = pi_ref / pi``), the estimators of ``KL(pi || pi_ref) = E_pi[-log r]`` from John Schulman,
"Approximating KL Divergence" (2020) are

* ``k1 = -log r = logp - ref_logp``            unbiased, high variance, can be negative;
* ``k2 = 0.5 * (log r)^2``                     biased, low variance, >= 0;
* ``k3 = (r - 1) - log r``                     unbiased, low variance, >= 0 (the "low_var_kl" of
  GRPO, Shao et al. 2024, eq. 4).

Use one either as a reward penalty (``apply_kl_penalty``: ``r_t <- r_t - beta * kl_t``, the
InstructGPT / PPO-RLHF recipe, Ouyang et al. 2022; also REINFORCE++) or as a loss term
(``kl_loss``, GRPO). The coefficient ``beta`` comes from a ``FixedKLController`` or the
``AdaptiveKLController`` of Ziegler et al. 2019, "Fine-Tuning Language Models from Human
Preferences".
"""

from __future__ import annotations

import torch

from megarl.algorithms.aggregation import agg_loss, masked_mean

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    estimator: str = "k3",
    response_mask: torch.Tensor | None = None,
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token KL estimate ``[batch, response_len]`` (``k1``, ``k2`` or ``k3``, see module doc).

    ``clamp`` bounds ``log r`` to ``[-clamp, clamp]`` before estimating (k3 grows like ``e^|log r|``;
    verl clamps k3 to [-10, 10]). Padding positions (where ``response_mask`` is 0) are 0.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {list(KL_ESTIMATORS)}")
    log_r = ref_logp - logp
    if response_mask is not None:
        # Select padding away *before* exp, so garbage there cannot overflow.
        log_r = torch.where(response_mask.bool(), log_r, log_r.new_zeros(()))
    if clamp is not None:
        log_r = log_r.clamp(-clamp, clamp)
    if estimator == "k1":
        kl = -log_r
    elif estimator == "k2":
        kl = 0.5 * log_r**2
    else:
        kl = torch.expm1(log_r) - log_r
    return kl


def apply_kl_penalty(
    token_rewards: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    response_mask: torch.Tensor,
    beta: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL as a reward penalty: ``r_t - beta * kl_t`` on response tokens, 0 on padding.

    Returns the penalised token rewards and metrics ``{"kl": masked mean of kl_t, "kl_coef": beta}``;
    feed ``metrics["kl"]`` (the mean per-token KL) to a KL controller's ``update``. Computed
    without gradient: rewards are data, not part of the graph.
    """
    with torch.no_grad():
        kl = kl_estimate(logp, ref_logp, estimator, response_mask)
        m = response_mask.bool()
        rewards = torch.where(m, token_rewards - beta * kl, token_rewards.new_zeros(()))
        metrics = {"kl": masked_mean(kl, m), "kl_coef": torch.tensor(float(beta))}
    return rewards, metrics


def kl_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    response_mask: torch.Tensor,
    estimator: str = "k3",
    loss_agg_mode: str = "token-mean",
    max_len: int | None = None,
    clamp: float | None = 10.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL as a loss term (GRPO, Shao et al. 2024): ``agg(kl_t)``; multiply by ``beta`` yourself.

    Gradients flow through ``logp`` only (``ref_logp`` is a constant of the frozen reference).
    """
    kl = kl_estimate(logp, ref_logp.detach(), estimator, response_mask, clamp=clamp)
    loss = agg_loss(kl, response_mask, loss_agg_mode, max_len)
    return loss, {"kl_loss": loss.detach()}


class FixedKLController:
    """A constant KL coefficient; ``update`` is a no-op (kept so both controllers are swappable)."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (section 2.2), as used in PPO-RLHF.

    After a batch with observed KL ``kl`` spanning ``n_steps`` samples:
    ``e = clip(kl / target - 1, -0.2, 0.2)`` and ``beta <- beta * (1 + e * n_steps / horizon)``.
    So beta grows while the policy drifts further than ``target`` and shrinks otherwise, by at
    most 20% per ``horizon`` samples.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        current_kl = float(current_kl)
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])
