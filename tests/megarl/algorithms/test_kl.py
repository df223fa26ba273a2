import math

import pytest
import torch

from megarl.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_estimate,
    kl_loss,
)


def test_estimators_by_hand():
    # pi = 0.5, pi_ref = 0.25: log r = log(pi_ref / pi) = log 0.5.
    logp = torch.tensor([[math.log(0.5)]], dtype=torch.float64)
    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    lr = math.log(0.5)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(-lr)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * lr * lr)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 - lr)


def test_k1_and_k3_are_unbiased_k2_is_not():
    # Exact expectation over a categorical pi (no sampling): sum_x pi(x) k(x) vs KL(pi || pi_ref).
    pi = [0.5, 0.3, 0.15, 0.05]
    pref = [0.1, 0.2, 0.3, 0.4]
    exact = sum(p * math.log(p / q) for p, q in zip(pi, pref))
    logp = torch.tensor([[math.log(p) for p in pi]], dtype=torch.float64)
    ref = torch.tensor([[math.log(q) for q in pref]], dtype=torch.float64)
    w = torch.tensor([pi], dtype=torch.float64)
    for est in ("k1", "k3"):
        assert (w * kl_estimate(logp, ref, est)).sum().item() == pytest.approx(exact, rel=1e-12)
    assert abs((w * kl_estimate(logp, ref, "k2")).sum().item() - exact) > 1e-3


def test_k2_k3_nonnegative_and_padding_is_zero():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 6, generator=g)
    ref = torch.randn(4, 6, generator=g)
    mask = torch.ones(4, 6)
    mask[1, 3:] = 0
    mask[2] = 0
    ref[2] = float("inf")  # garbage on padding must not overflow
    logp[1, 4] = float("nan")
    for est in ("k1", "k2", "k3"):
        kl = kl_estimate(logp, ref, est, mask)
        assert torch.isfinite(kl).all()
        assert (kl[mask == 0] == 0).all()
        if est != "k1":
            assert (kl >= 0).all()


def test_clamp_bounds_log_ratio():
    logp = torch.tensor([[0.0]])
    ref = torch.tensor([[50.0]])
    assert kl_estimate(logp, ref, "k3", clamp=10.0).item() == pytest.approx(math.expm1(10.0) - 10.0, rel=1e-6)
    with pytest.raises(ValueError, match="k3"):
        kl_estimate(logp, ref, "k4")


def test_apply_kl_penalty_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -9.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.5, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out, metrics = apply_kl_penalty(rewards, logp, ref, mask, beta=0.1, estimator="k1")
    # k1 = logp - ref: [[0.5, -1, 0], [-0.5, 0, pad]]
    expected = torch.tensor([[-0.05, 0.1, 1.0], [0.05, 2.0, 0.0]])
    assert torch.allclose(out, expected)
    assert metrics["kl"].item() == pytest.approx((0.5 - 1 + 0 - 0.5 + 0) / 5)
    assert metrics["kl_coef"].item() == pytest.approx(0.1)


def test_kl_loss_k3_gradient():
    logp = torch.tensor([[-1.0, -2.0, -0.3], [-0.7, -0.1, -5.0]], requires_grad=True)
    ref = torch.tensor([[-1.2, -1.0, -0.3], [-0.2, -0.4, 3.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, metrics = kl_loss(logp, ref, mask, estimator="k3")
    (g,) = torch.autograd.grad(loss, logp)
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp); token-mean over 5 tokens.
    for i in range(2):
        for t in range(3):
            want = (1 - math.exp(ref[i, t].item() - logp[i, t].item())) / 5 if mask[i, t] else 0.0
            assert g[i, t].item() == pytest.approx(want, rel=1e-5, abs=1e-7)
    manual = sum(
        math.exp(ref[i, t].item() - logp[i, t].item()) - (ref[i, t].item() - logp[i, t].item()) - 1
        for i in range(2) for t in range(3) if mask[i, t]
    ) / 5
    assert loss.item() == pytest.approx(manual, rel=1e-6)
    assert metrics["kl_loss"].item() == pytest.approx(manual, rel=1e-6)


def test_fixed_controller():
    c = FixedKLController(0.05)
    assert c.update(100.0, 512) == 0.05 and c.value == 0.05
    with pytest.raises(ValueError):
        FixedKLController(-1.0)


def test_adaptive_controller_ziegler_update_by_hand():
    c = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    c.update(current_kl=9.0, n_steps=256)  # error 0.5 clipped to 0.2
    assert c.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    v = c.value
    c.update(current_kl=6.6, n_steps=100)  # error 0.1 (inside the clip)
    assert c.value == pytest.approx(v * (1 + 0.1 * 100 / 10000))
    v = c.value
    c.update(current_kl=0.0, n_steps=1000)  # error -1 clipped to -0.2
    assert c.value == pytest.approx(v * (1 - 0.2 * 1000 / 10000))
    v = c.value
    c.update(current_kl=6.0, n_steps=1000)  # on target: unchanged
    assert c.value == pytest.approx(v)

    d = AdaptiveKLController(1.0, 1.0, 1)
    d.load_state_dict(c.state_dict())
    assert (d.value, d.target, d.horizon) == (c.value, 6.0, 10000)
    for bad in [dict(init_kl_coef=-1, target_kl=1, horizon=1), dict(init_kl_coef=1, target_kl=0, horizon=1),
                dict(init_kl_coef=1, target_kl=1, horizon=0)]:
        with pytest.raises(ValueError):
            AdaptiveKLController(**bad)
