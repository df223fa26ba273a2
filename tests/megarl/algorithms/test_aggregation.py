import math
import statistics

import pytest
import torch

from megarl.algorithms.aggregation import LOSS_AGG_MODES, agg_loss, masked_mean, masked_sum, masked_var, masked_whiten

LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.float64)


def test_masked_sum_and_mean_by_hand():
    assert masked_sum(LOSS, MASK).item() == 29.0
    assert masked_mean(LOSS, MASK).item() == pytest.approx(29.0 / 6)
    assert masked_sum(LOSS, MASK, dim=-1).tolist() == [3.0, 26.0, 0.0]
    # Empty row -> 0, not NaN.
    assert masked_mean(LOSS, MASK, dim=-1).tolist() == [1.5, 6.5, 0.0]
    assert masked_mean(LOSS, torch.zeros_like(MASK)).item() == 0.0


def test_padding_values_never_leak_even_nan():
    garbage = LOSS.clone()
    garbage[MASK == 0] = float("nan")
    garbage[2, 0] = float("inf")
    assert masked_sum(garbage, MASK).item() == 29.0
    for mode in LOSS_AGG_MODES:
        assert agg_loss(garbage, MASK, mode).item() == agg_loss(LOSS, MASK, mode).item()


def test_masked_var_and_whiten_match_statistics_module():
    x = torch.tensor([[0.3, -1.2, 4.0, 9.9], [2.5, 0.0, -7.0, 1.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    vals = [0.3, -1.2, 4.0, 0.0, -7.0, 1.0]
    assert masked_var(x, m).item() == pytest.approx(statistics.variance(vals))
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(statistics.pvariance(vals))
    mu, var = statistics.mean(vals), statistics.variance(vals)
    w = masked_whiten(x, m)
    expected = [[(v - mu) / math.sqrt(var + 1e-8) for v in row] for row in x.tolist()]
    for i in range(2):
        for t in range(4):
            want = expected[i][t] if m[i, t] else 0.0
            assert w[i, t].item() == pytest.approx(want)
    w2 = masked_whiten(x, m, shift_mean=False)
    assert w2[0, 0].item() == pytest.approx(expected[0][0] + mu)
    assert w2[0, 3].item() == 0.0


def test_var_of_fewer_than_two_values_is_zero():
    x = torch.tensor([[5.0, 1.0]])
    assert masked_var(x, torch.tensor([[1, 0]])).item() == 0.0
    assert masked_var(x, torch.tensor([[0, 0]])).item() == 0.0
    w = masked_whiten(x, torch.tensor([[1, 0]]))
    assert torch.equal(w, torch.zeros_like(x))


def test_agg_modes_by_hand():
    assert agg_loss(LOSS, MASK, "token-mean").item() == pytest.approx(29 / 6)
    # Row sums 3 and 26; the all-padding row is not a sequence.
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum").item() == pytest.approx(14.5)
    assert agg_loss(LOSS, MASK, "seq-mean-token-mean").item() == pytest.approx((1.5 + 6.5) / 2)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm").item() == pytest.approx((3 / 4 + 26 / 4) / 2)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", max_len=10).item() == pytest.approx((0.3 + 2.6) / 2)


def test_agg_all_padding_gives_zero_and_zero_grad():
    x = LOSS.clone().requires_grad_(True)
    for mode in LOSS_AGG_MODES:
        out = agg_loss(x, torch.zeros_like(MASK), mode)
        assert out.item() == 0.0
        (g,) = torch.autograd.grad(out, x)
        assert torch.equal(g, torch.zeros_like(g))


def test_agg_gradients_are_the_per_token_weights():
    x = LOSS.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(agg_loss(x, MASK, "token-mean"), x)
    assert torch.allclose(g, MASK / 6)
    (g,) = torch.autograd.grad(agg_loss(x, MASK, "seq-mean-token-mean"), x)
    expected = torch.tensor([[1 / 4, 1 / 4, 0, 0], [1 / 8] * 4, [0] * 4], dtype=torch.float64)
    assert torch.allclose(g, expected)
    (g,) = torch.autograd.grad(agg_loss(x, MASK, "seq-mean-token-sum-norm", max_len=5), x)
    assert torch.allclose(g, MASK / (2 * 5))


def test_agg_bad_inputs():
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(LOSS, MASK, "sequence-mean")
    with pytest.raises(ValueError, match="shape"):
        agg_loss(LOSS, MASK[:, :3], "token-mean")
    with pytest.raises(ValueError, match="max_len"):
        agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", max_len=0)
