"""Rollout corrections and mismatch metrics (megarl/algorithms/rollout_correction.py) against
closed forms computed by hand on small batches."""

import math

import pytest
import torch

from megarl.algorithms import (
    list_rollout_corrections,
    ppo_policy_loss,
    register_rollout_correction,
    registry,
    rollout_correction_weights,
    rollout_mismatch_metrics,
)

# Two sequences; ratios r = p_old / p_rollout chosen per token; the last token of row 1 is padding.
RATIOS = torch.tensor([[0.5, 1.0, 3.0], [1.5, 0.25, float("nan")]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -3.0, 0.0]])
OLD = ROLLOUT + RATIOS.log()


def weights(method, low=0.6, high=2.0):
    return rollout_correction_weights(method, OLD, ROLLOUT, MASK, low, high)


def test_token_level_corrections():
    assert torch.allclose(weights("tis"), torch.tensor([[0.5, 1.0, 2.0], [1.5, 0.25, 0.0]]))
    assert torch.allclose(weights("mis"), torch.tensor([[0.5, 1.0, 0.0], [1.5, 0.25, 0.0]]))
    assert torch.allclose(weights("icepop"), torch.tensor([[0.0, 1.0, 0.0], [1.5, 0.0, 0.0]]))


def test_sequence_level_corrections():
    # R = product of the sequence's token ratios: 0.5 * 1 * 3 = 1.5 and 1.5 * 0.25 = 0.375
    assert torch.allclose(weights("seq_tis", high=1.2), torch.tensor([[1.2] * 3, [0.375, 0.375, 0.0]]))
    assert torch.allclose(weights("seq_mis", high=1.2), torch.tensor([[0.0] * 3, [0.375, 0.375, 0.0]]))
    assert torch.allclose(weights("seq_mis", high=2.0), torch.tensor([[1.5] * 3, [0.375, 0.375, 0.0]]))


def test_weights_scale_the_ppo_objective_token_by_token():
    """PPO with advantages w * A is the token mean of w times PPO's per-token term (w >= 0)."""
    logp = (OLD + torch.tensor([[0.1, -0.3, 0.05], [0.4, -0.1, 0.0]])).requires_grad_()
    adv = torch.tensor([[1.0, -2.0, 0.5], [-1.0, 3.0, 9.0]])
    w = weights("tis")
    loss, _ = ppo_policy_loss(logp=logp, old_logp=OLD.nan_to_num(), advantages=adv * w, response_mask=MASK,
                              loss_agg_mode="token-mean", clip_low=0.2)
    ratio = (logp - OLD).exp()
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    expected = (w * per_token)[MASK.bool()].sum() / MASK.sum()
    torch.testing.assert_close(loss, expected)


def test_mismatch_metrics():
    m = rollout_mismatch_metrics(OLD, ROLLOUT, MASK, low=0.6, high=2.0)
    logs = [math.log(r) for r in (0.5, 1.0, 3.0, 1.5, 0.25)]
    assert math.isclose(float(m["abs_logp_diff"]), sum(abs(x) for x in logs) / 5, rel_tol=1e-6)
    assert math.isclose(float(m["kl_k3"]), sum(math.exp(x) - 1 - x for x in logs) / 5, rel_tol=1e-6)
    assert math.isclose(float(m["ppl_ratio"]), math.exp(-sum(logs) / 5), rel_tol=1e-6)
    assert math.isclose(float(m["outside_bounds"]), 3 / 5, rel_tol=1e-6)  # 0.5, 3.0 and 0.25
    same = rollout_mismatch_metrics(ROLLOUT, ROLLOUT, MASK, low=0.6, high=2.0)
    assert float(same["abs_logp_diff"]) == float(same["kl_k3"]) == float(same["outside_bounds"]) == 0.0
    assert float(same["ppl_ratio"]) == 1.0


def test_padding_and_overflow_never_propagate():
    old = OLD.clone()
    old[0, 2] = 500.0  # a stale token whose ratio would overflow exp
    w = rollout_correction_weights("seq_mis", old, ROLLOUT, MASK, 0.5, 2.0)
    assert torch.isfinite(w).all() and w[0].eq(0).all()
    assert rollout_correction_weights("tis", old, ROLLOUT, MASK, 0.5, 2.0)[1, 2] == 0  # padding (NaN there)


def test_a_user_correction_registers_and_unknown_names_are_listed():
    saved = dict(registry._ROLLOUT_CORRECTIONS)
    try:
        @register_rollout_correction("halve")
        def halve(*, log_ratio, response_mask, low, high):
            return torch.full_like(log_ratio, 0.5)

        assert "halve" in list_rollout_corrections()
        assert torch.equal(weights("halve"), 0.5 * MASK.float())
    finally:
        registry._ROLLOUT_CORRECTIONS.clear()
        registry._ROLLOUT_CORRECTIONS.update(saved)
    with pytest.raises(ValueError, match=r"unknown rollout correction 'tsi'; registered: \['icepop', 'mis'"):
        weights("tsi")
