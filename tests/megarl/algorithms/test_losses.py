import math

import pytest
import torch

from megarl.algorithms.policy_loss import (
    entropy_from_logits,
    gspo_policy_loss,
    masked_entropy,
    ppo_policy_loss,
    value_loss,
    vanilla_policy_loss,
)
from megarl.algorithms.registry import get_policy_loss

F64 = torch.float64


def leaf(x):
    return torch.tensor(x, dtype=F64, requires_grad=True)


# ----------------------------------------------------------------------------- PPO

# One token per case: (ratio, advantage, clipped?) for clip_low=0.2, clip_high=0.28, dual c=3.
PPO_CASES = [
    (1.5, 1.0, True),     # A>0, ratio above 1+eps_high: clipped, no gradient
    (1.25, 1.0, False),   # A>0, inside the clip-higher range (would be clipped at symmetric 0.2)
    (0.5, 1.0, False),    # A>0, ratio below 1-eps: unclipped (pessimistic min keeps it)
    (0.5, -1.0, True),    # A<0, ratio below 1-eps: clipped
    (1.5, -1.0, False),   # A<0, ratio above: unclipped, below the dual bound
    (4.0, -2.0, True),    # A<0, ratio above clip_ratio_c=3: dual-clipped to -A*c
    (1.0, 0.7, False),    # on-policy
]


def ppo_inputs(cases, pad_garbage=True):
    n = len(cases)
    old = torch.full((2, n), -1.0, dtype=F64)
    logp = leaf([[-1.0 + math.log(r) for r, _, _ in cases], [0.0] * n])
    adv = torch.tensor([[a for _, a, _ in cases], [0.0] * n], dtype=F64)
    mask = torch.tensor([[1] * n, [0] * n])
    if pad_garbage:
        old[1] = float("nan")
        adv[1] = float("inf")
    return logp, old, adv, mask


def ref_ppo_token(r, a, lo, hi, c):
    loss = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
    if c is not None and a < 0:
        loss = min(loss, -a * c)
    return loss


def test_ppo_loss_gradient_and_metrics_by_hand():
    logp, old, adv, mask = ppo_inputs(PPO_CASES)
    loss, metrics = ppo_policy_loss(
        logp=logp, old_logp=old, advantages=adv, response_mask=mask, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0
    )
    n = len(PPO_CASES)
    expected = sum(ref_ppo_token(r, a, 0.2, 0.28, 3.0) for r, a, _ in PPO_CASES) / n
    assert loss.item() == pytest.approx(expected)
    (g,) = torch.autograd.grad(loss, logp)
    for k, (r, a, clipped) in enumerate(PPO_CASES):
        # d(-A * rho)/dlogp = -A * rho for live tokens, 0 for clipped ones (token-mean over n).
        want = 0.0 if clipped else -a * r / n
        assert g[0, k].item() == pytest.approx(want, abs=1e-12), (k, r, a)
    assert torch.equal(g[1], torch.zeros(n, dtype=F64))  # padding row
    # clip active on cases 0 and 3 only (case 5's ratio is inside [0.8, 1.28]? no: 4 > 1.28 but A<0
    # makes the unclipped term the larger one, so only the dual clip bounds it).
    assert metrics["clipfrac"].item() == pytest.approx(2 / n)
    assert metrics["clipfrac_dual"].item() == pytest.approx(1 / n)
    log_r = [math.log(r) for r, _, _ in PPO_CASES]
    assert metrics["ppo_kl"].item() == pytest.approx(-sum(log_r) / n)
    assert metrics["approx_kl"].item() == pytest.approx(sum(math.expm1(x) - x for x in log_r) / n)
    assert metrics["ratio_mean"].item() == pytest.approx(sum(r for r, _, _ in PPO_CASES) / n)


def test_ppo_symmetric_default_and_no_dual_clip():
    logp, old, adv, mask = ppo_inputs(PPO_CASES)
    loss, _ = ppo_policy_loss(logp=logp, old_logp=old, advantages=adv, response_mask=mask)
    expected = sum(ref_ppo_token(r, a, 0.2, 0.2, None) for r, a, _ in PPO_CASES) / len(PPO_CASES)
    assert loss.item() == pytest.approx(expected)
    (g,) = torch.autograd.grad(loss, logp)
    assert g[0, 1].item() == 0.0  # ratio 1.25 > 1.2 with A>0: clipped without clip-higher
    assert g[0, 5].item() == pytest.approx(2.0 * 4.0 / len(PPO_CASES))  # no dual clip: live


def test_ppo_agg_modes_and_validation():
    logp = leaf([[-1.0, -1.0, 0.0], [-1.0, -1.0, -1.0]])
    old = torch.full((2, 3), -1.0, dtype=F64)
    adv = torch.tensor([[1.0, 3.0, 0.0], [2.0, 2.0, 2.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # ratio 1 everywhere: per-token loss = -A
    cases = {"token-mean": -10 / 5, "seq-mean-token-sum": -(4 + 6) / 2, "seq-mean-token-mean": -(2 + 2) / 2,
             "seq-mean-token-sum-norm": -(4 / 3 + 6 / 3) / 2}
    for mode, want in cases.items():
        loss, _ = ppo_policy_loss(logp=logp, old_logp=old, advantages=adv, response_mask=mask, loss_agg_mode=mode)
        assert loss.item() == pytest.approx(want), mode
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_policy_loss(logp=logp, old_logp=old, advantages=adv, response_mask=mask, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="clip_low"):
        ppo_policy_loss(logp=logp, old_logp=old, advantages=adv, response_mask=mask, clip_low=1.0)
    with pytest.raises(ValueError, match="shape"):
        ppo_policy_loss(logp=logp, old_logp=old[:, :2], advantages=adv, response_mask=mask)


# ----------------------------------------------------------------------------- GSPO


def gspo_batch():
    g = torch.Generator().manual_seed(0)
    B, T = 5, 6
    lengths = [6, 3, 1, 4, 0]  # last row: empty response
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    old = -torch.rand(B, T, generator=g, dtype=F64) - 0.5
    logp = old + 1e-4 * torch.randn(B, T, generator=g, dtype=F64)
    logp[0] = old[0] + 5e-3  # sequence 0 far outside the clip range (s = e^0.005)
    logp[1] = old[1] - 5e-3  # sequence 1 below the range
    adv_seq = torch.tensor([1.0, -1.0, 0.5, -0.3, 2.0], dtype=F64)
    logp[mask == 0] = float("nan")  # garbage on padding
    return logp.requires_grad_(True), old, adv_seq, mask, lengths


def test_gspo_value_and_gradient_equal_the_sequence_level_objective():
    logp, old, adv_seq, mask, lengths = gspo_batch()
    adv = adv_seq[:, None].expand_as(old).clone()
    loss, metrics = gspo_policy_loss(logp=logp, old_logp=old, advantages=adv, response_mask=mask)
    (g,) = torch.autograd.grad(loss, logp)

    # Independent sequence-level GSPO: J = 1/G sum_i min(s_i A_i, clip(s_i) A_i), gradient through s_i.
    x = logp.detach().clone().requires_grad_(True)
    terms = []
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        s = torch.exp(sum(x[i, t] - old[i, t] for t in range(n)) / n)
        a = adv_seq[i]
        terms.append(-torch.minimum(s * a, s.clamp(1 - 3e-4, 1 + 4e-4) * a))
    ref_loss = sum(terms) / len(terms)
    (ref_g,) = torch.autograd.grad(ref_loss, x)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-12)
    assert torch.allclose(g, torch.nan_to_num(ref_g * mask), atol=1e-15)
    assert torch.isfinite(g).all() and (g[mask == 0] == 0).all()
    # Closed form: d/dlogp_it = -A_i s_i / (|y_i| G) for unclipped sequences, 0 for clipped ones.
    G = 4
    for i, n in enumerate(lengths[:4]):
        s = math.exp(sum((logp[i, t] - old[i, t]).item() for t in range(n)) / n)
        clipped = (adv_seq[i] > 0 and s > 1 + 4e-4) or (adv_seq[i] < 0 and s < 1 - 3e-4)
        want = 0.0 if clipped else -adv_seq[i].item() * s / (n * G)
        assert g[i, :n].tolist() == pytest.approx([want] * n, rel=1e-9, abs=1e-15)
    assert (g[0] == 0).all() and (g[1] == 0).all()  # the two clipped sequences
    assert (g[2, :1] != 0).all() and (g[3, :4] != 0).all()  # the two live ones
    # clipfrac is token-weighted: rows 0 and 1 (6 + 3 tokens) of 14 tokens.
    assert metrics["clipfrac"].item() == pytest.approx(9 / 14)


def test_gspo_token_advantages_get_per_token_weights():
    # With token-level advantages, the gradient at token t is -A_t * s_i / |y_i| / G.
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64)
    logp = (old + 1e-5).requires_grad_(True)
    adv = torch.tensor([[1.0, -2.0, 0.5]], dtype=F64)
    loss, _ = get_policy_loss("gspo")(logp=logp, old_logp=old, advantages=adv, response_mask=torch.ones(1, 3))
    (g,) = torch.autograd.grad(loss, logp)
    s = math.exp(1e-5)
    assert g[0].tolist() == pytest.approx([-1.0 * s / 3, 2.0 * s / 3, -0.5 * s / 3], rel=1e-9)


# ----------------------------------------------------------------------------- vanilla PG


def test_vanilla_loss_and_gradient():
    logp = leaf([[-1.0, -2.0, float("nan")], [-0.5, -0.1, -3.0]])
    adv = torch.tensor([[1.0, -1.0, 5.0], [2.0, 0.0, -1.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, metrics = vanilla_policy_loss(logp=logp, advantages=adv, response_mask=mask)
    assert loss.item() == pytest.approx(-(-1.0 + 2.0 - 1.0 + 0.0 + 3.0) / 5)
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(g, -torch.where(mask.bool(), adv, 0.0) / 5)
    assert "approx_kl" not in metrics
    _, metrics = get_policy_loss("vanilla")(
        logp=logp, old_logp=logp.detach().nan_to_num(), advantages=adv, response_mask=mask
    )
    assert metrics["approx_kl"].item() == 0.0


def test_sft_loss_is_masked_negative_log_likelihood():
    logp = leaf([[-1.0, -2.0, float("nan")], [-0.5, -0.1, -3.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    loss, metrics = get_policy_loss("sft")(logp=logp, old_logp=None, advantages=None, response_mask=mask,
                                           loss_agg_mode="token-mean", max_len=None)
    assert loss.item() == pytest.approx((1.0 + 0.5 + 0.1 + 3.0) / 4)
    assert metrics["nll"].item() == loss.item()
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.equal(g, -mask.to(F64) / 4)


# ----------------------------------------------------------------------------- value loss


def test_value_loss_clipping_by_hand():
    # returns 2, old values 1, clip 0.2
    v = leaf([[1.5, 1.1, 0.5, 1.9]])
    old = torch.tensor([[1.0, 1.0, 1.0, 2.0]], dtype=F64)
    ret = torch.tensor([[2.0, 2.0, 2.0, 2.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = value_loss(values=v, old_values=old, returns=ret, response_mask=mask, clip_range_value=0.2)
    # token 0: unclipped 0.25, clipped (1.2-2)^2=0.64 -> 0.32, grad 0 (clip saturated)
    # token 1: both 0.81 -> 0.405, grad (1.1-2)
    # token 2: unclipped 2.25, clipped (0.8-2)^2=1.44 -> 1.125, grad (0.5-2)
    assert loss.item() == pytest.approx((0.32 + 0.405 + 1.125) / 3)
    (g,) = torch.autograd.grad(loss, v)
    assert g[0].tolist() == pytest.approx([0.0, -0.9 / 3, -1.5 / 3, 0.0])
    assert metrics["vf_clipfrac"].item() == pytest.approx(1 / 3)
    loss_plain, _ = value_loss(values=v, old_values=old, returns=ret, response_mask=mask, clip_range_value=None)
    assert loss_plain.item() == pytest.approx(0.5 * (0.25 + 0.81 + 2.25) / 3)


# ----------------------------------------------------------------------------- entropy


def test_entropy_from_logits_against_formula():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 7, generator=g, dtype=F64)
    ent = entropy_from_logits(logits)
    for i in range(2):
        for t in range(3):
            z = logits[i, t].tolist()
            mx = max(z)
            w = [math.exp(v - mx) for v in z]
            p = [v / sum(w) for v in w]
            assert ent[i, t].item() == pytest.approx(-sum(q * math.log(q) for q in p), rel=1e-12)
    assert entropy_from_logits(torch.zeros(5)).item() == pytest.approx(math.log(5))


def test_entropy_with_masked_vocab_is_finite_with_finite_grad():
    logits = torch.tensor([[[0.0, float("-inf"), float("-inf")], [1.0, 1.0, float("-inf")]]], requires_grad=True)
    ent = entropy_from_logits(logits)
    assert ent[0].tolist() == pytest.approx([0.0, math.log(2)])
    (g,) = torch.autograd.grad(ent.sum(), logits)
    assert torch.isfinite(g).all()


def test_masked_entropy_mean_over_response_tokens():
    logits = torch.zeros(2, 3, 4)
    logits[0, 0] = torch.tensor([10.0, -10.0, -10.0, -10.0])
    logits[1, 2] = float("nan")  # padding garbage
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    ent = entropy_from_logits(logits)
    want = (ent[0, 0] + ent[0, 1] + ent[1, 0]) / 3
    assert masked_entropy(logits, mask).item() == pytest.approx(want.item())
    assert masked_entropy(logits, torch.zeros(2, 3)).item() == 0.0
    with pytest.raises(ValueError, match="vocab"):
        masked_entropy(logits[0], mask)


# ----------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("name", ["ppo", "gspo", "vanilla"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_empty_and_all_padding_batches(name, mode):
    fn = get_policy_loss(name)
    logp = leaf([[-1.0, -2.0], [float("nan"), float("nan")]])
    old = torch.tensor([[-1.1, -1.9], [float("nan"), 5.0]], dtype=F64)
    adv = torch.tensor([[1.0, 1.0], [float("inf"), 1.0]], dtype=F64)
    for mask in (torch.tensor([[1, 1], [0, 0]]), torch.zeros(2, 2)):
        loss, metrics = fn(logp=logp, old_logp=old, advantages=adv, response_mask=mask, loss_agg_mode=mode)
        (g,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(g).all()
        assert all(torch.isfinite(v).all() for v in metrics.values())
        assert (g[1] == 0).all()
        if mask.sum() == 0:
            assert loss.item() == 0.0 and (g == 0).all()
        else:
            assert (g[0] != 0).any()


def test_gspo_default_asymmetric_clip_range():
    # Paper defaults: clip_low 3e-4, clip_high 4e-4. log s = +3.5e-4 is inside the upper bound,
    # log s = -3.5e-4 is outside the lower one (1 - 3.5e-4 < 1 - 3e-4).
    old = torch.zeros(4, 2, dtype=F64)
    shift = torch.tensor([[3.5e-4], [3.5e-4], [-3.5e-4], [-3.5e-4]], dtype=F64)
    logp = (old + shift).requires_grad_(True)
    adv = torch.tensor([[1.0], [-1.0], [1.0], [-1.0]], dtype=F64).expand(4, 2)
    loss, metrics = gspo_policy_loss(logp=logp, old_logp=old, advantages=adv, response_mask=torch.ones(4, 2))
    (g,) = torch.autograd.grad(loss, logp)
    live = [g[i].abs().sum().item() > 0 for i in range(4)]
    # row 0: s inside (A>0 live); row 1: A<0, s>1: unclipped side; row 2: A>0, s<1: min keeps it live;
    # row 3: A<0 with s below 1 - clip_low: clipped.
    assert live == [True, True, True, False]
    assert metrics["clipfrac"].item() == pytest.approx(0.25)


def test_low_precision_inputs_are_computed_in_fp32():
    old = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16)
    logp = (old + 0.01).detach().requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.bfloat16)
    for name in ("ppo", "gspo", "vanilla"):
        loss, _ = get_policy_loss(name)(logp=logp, old_logp=old, advantages=adv, response_mask=torch.ones(1, 2))
        assert loss.dtype == torch.float32
        (g,) = torch.autograd.grad(loss, logp)
        assert g.dtype == torch.bfloat16 and torch.isfinite(g).all()
