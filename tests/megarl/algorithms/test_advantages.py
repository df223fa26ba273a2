"""Advantage estimators against hand-computed numbers and independent plain-Python loops.

The reference loops work on lists: they first compress each row to its valid tokens (so
padding is simply absent), then apply the textbook formula, then scatter back.
"""

import math
import statistics

import pytest
import torch

from megarl.algorithms import advantages as A
from megarl.algorithms.registry import get_advantage

F64 = torch.float64


# ----------------------------------------------------------------------------- reference loops


def rows(mask):
    return [[t for t, v in enumerate(row) if v] for row in mask.tolist()]


def scatter(per_row_values, mask):
    out = torch.zeros(mask.shape, dtype=F64)
    for i, idx in enumerate(rows(mask)):
        for t, v in zip(idx, per_row_values[i]):
            out[i, t] = v
    return out


def ref_returns(rewards, mask, gamma):
    out = []
    for i, idx in enumerate(rows(mask)):
        r = [rewards[i][t] for t in idx]
        g, running = [0.0] * len(r), 0.0
        for k in reversed(range(len(r))):
            running = r[k] + gamma * running
            g[k] = running
        out.append(g)
    return out


def ref_gae(rewards, values, mask, gamma, lam):
    advs = []
    for i, idx in enumerate(rows(mask)):
        r = [rewards[i][t] for t in idx]
        v = [values[i][t] for t in idx] + [0.0]
        a, last = [0.0] * len(r), 0.0
        for k in reversed(range(len(r))):
            delta = r[k] + gamma * v[k + 1] - v[k]
            last = delta + gamma * lam * last
            a[k] = last
        advs.append(a)
    return advs


def ref_whiten(per_row, eps=1e-8):
    flat = [x for row in per_row for x in row]
    mu, var = statistics.mean(flat), statistics.variance(flat)
    return [[(x - mu) / math.sqrt(var + eps) for x in row] for row in per_row]


def group_members(index):
    return [[j for j in range(len(index)) if index[j] == index[i]] for i in range(len(index))]


def random_batch(seed, B=10, T=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = 0, T  # an empty response and a full one
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(F64)
    mask[2, 1] = 0 if lengths[2] > 2 else mask[2, 1]  # a hole inside a response
    rewards = torch.randn(B, T, generator=g, dtype=F64)
    values = torch.randn(B, T, generator=g, dtype=F64)
    return rewards, values, mask


def assert_matches(actual, expected_rows, mask, **tol):
    expected = scatter(expected_rows, mask)
    assert torch.allclose(actual.to(F64), expected, **tol), (actual, expected)
    assert (actual[mask == 0] == 0).all()


# ----------------------------------------------------------------------------- helpers


def test_scores_to_token_rewards_last_valid_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    out = A.scores_to_token_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    expected = torch.tensor([[0, 0, 1.0, 0], [0, 0, 2.0, 0], [0, 0, 0, 0], [0, 0, 0, 4.0]])
    assert torch.equal(out, expected)
    assert A.sequence_scores(out, mask).tolist() == [1.0, 2.0, 0.0, 4.0]


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_discounted_returns_against_loop(gamma):
    rewards, _, mask = random_batch(1)
    expected = ref_returns(rewards.tolist(), mask, gamma)
    assert_matches(A.discounted_returns(rewards, mask, gamma), expected, mask)


def test_group_stats_by_hand_and_with_string_ids():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 2.0, 2.0])
    idx = torch.tensor([7, 7, 7, 7, 3, 9, 9])
    st = A.group_stats(scores, idx)
    assert st.size.tolist() == [4, 4, 4, 4, 1, 2, 2]
    assert st.mean.tolist() == [0.5] * 4 + [5.0, 2.0, 2.0]
    assert st.std[:4].tolist() == pytest.approx([math.sqrt(1 / 3)] * 4)
    assert st.std[4:].tolist() == [0.0, 0.0, 0.0]
    assert st.all_equal.tolist() == [False] * 4 + [True] * 3
    st2 = A.group_stats(scores, ["a", "a", "a", "a", "b", "c", "c"])
    assert torch.equal(st2.mean, st.mean) and torch.equal(st2.std, st.std)
    with pytest.raises(ValueError, match="integer"):
        A.group_stats(scores, idx.float())
    with pytest.raises(ValueError, match="batch"):
        A.group_stats(scores, idx[:3])


# ----------------------------------------------------------------------------- GAE


def test_gae_closed_forms():
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=F64)
    v = torch.tensor([[0.2, 0.4, 0.6, 9.0]], dtype=F64)
    m = torch.tensor([[1, 1, 1, 0]])
    # gamma = lam = 1: A_t = (sum_{s>=t} r_s) - V_t = 1 - V_t; returns = 1 everywhere.
    adv, ret = A.compute_gae_advantage(token_rewards=r, response_mask=m, values=v, gamma=1.0, lam=1.0, whiten=False)
    assert torch.allclose(adv, torch.tensor([[0.8, 0.6, 0.4, 0.0]], dtype=F64))
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=F64))
    # lam = 0: A_t = r_t + gamma V_{t+1} - V_t (one-step TD error), V after the end = 0.
    adv, _ = A.compute_gae_advantage(token_rewards=r, response_mask=m, values=v, gamma=0.5, lam=0.0, whiten=False)
    assert torch.allclose(adv, torch.tensor([[0.5 * 0.4 - 0.2, 0.5 * 0.6 - 0.4, 1.0 - 0.6, 0.0]], dtype=F64))


def test_gae_hand_example_skips_padding_hole():
    # Valid tokens 0, 2 (token 1 is a hole). gamma=0.9, lam=0.8.
    r = torch.tensor([[0.5, 100.0, 1.0]], dtype=F64)
    v = torch.tensor([[1.0, 100.0, 2.0]], dtype=F64)
    m = torch.tensor([[1, 0, 1]])
    adv, ret = A.compute_gae_advantage(token_rewards=r, response_mask=m, values=v, gamma=0.9, lam=0.8, whiten=False)
    a2 = 1.0 - 2.0  # delta at the last token
    d0 = 0.5 + 0.9 * 2.0 - 1.0
    a0 = d0 + 0.9 * 0.8 * a2
    assert torch.allclose(adv, torch.tensor([[a0, 0.0, a2]], dtype=F64))
    assert torch.allclose(ret, torch.tensor([[a0 + 1.0, 0.0, a2 + 2.0]], dtype=F64))


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (0.7, 1.0)])
def test_gae_against_loop_and_whitening(gamma, lam):
    rewards, values, mask = random_batch(2)
    rewards_g, values_g = rewards.clone(), values.clone()
    rewards_g[mask == 0] = float("nan")  # garbage on padding must be ignored
    values_g[mask == 0] = float("inf")
    expected = ref_gae(rewards.tolist(), values.tolist(), mask, gamma, lam)
    adv, ret = A.compute_gae_advantage(
        token_rewards=rewards_g, response_mask=mask, values=values_g, gamma=gamma, lam=lam, whiten=False
    )
    assert_matches(adv, expected, mask)
    exp_ret = [[a + values[i, t].item() for a, t in zip(expected[i], rows(mask)[i])] for i in range(len(expected))]
    assert_matches(ret, exp_ret, mask)
    adv_w, _ = get_advantage("gae")(token_rewards=rewards_g, response_mask=mask, values=values_g, gamma=gamma, lam=lam)
    assert_matches(adv_w, ref_whiten(expected), mask)


# ----------------------------------------------------------------------------- GRPO / Dr.GRPO / RLOO


def test_grpo_by_hand():
    # group 0: scores 1, 0, 0, 0 (sample 3 has an empty response but still belongs to the group);
    # group 1: a single sample; group 2: 0.1, 0.1, 0.1 (zero std).
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 5.0, 0.1, 0.1, 0.1])
    idx = torch.tensor([0, 0, 0, 0, 1, 2, 2, 2])
    m = torch.ones(8, 3)
    m[1, 2] = 0
    m[3] = 0
    r = A.scores_to_token_rewards(scores, m)
    adv, ret = A.compute_grpo_outcome_advantage(token_rewards=r, response_mask=m, index=idx)
    # group 0: mean 0.25, unbiased std sqrt(((0.75)^2 + 3 * 0.25^2) / 3) = 0.5
    a_pos = (1 - 0.25) / (0.5 + 1e-6)
    a_neg = (0 - 0.25) / (0.5 + 1e-6)
    expected = torch.tensor([a_pos, a_neg, a_neg, 0.0, 0.0, 0.0, 0.0, 0.0])[:, None] * m
    assert torch.allclose(adv, expected)
    assert torch.equal(ret, adv)
    assert (adv[4:] == 0).all()  # size-1 group and zero-std group are exactly 0


def test_grpo_epsilon_and_drgrpo_by_hand():
    scores = torch.tensor([0.0, 1e-7, 3.0, 1.0], dtype=F64)
    idx = torch.tensor([0, 0, 1, 1])
    m = torch.ones(4, 2, dtype=F64)
    r = A.scores_to_token_rewards(scores, m)
    std0 = math.sqrt(2 * (0.5e-7) ** 2)
    std1 = math.sqrt(2.0)
    adv, _ = get_advantage("grpo")(token_rewards=r, response_mask=m, index=idx, epsilon=1e-6)
    want = [-0.5e-7 / (std0 + 1e-6), 0.5e-7 / (std0 + 1e-6), 1.0 / (std1 + 1e-6), -1.0 / (std1 + 1e-6)]
    assert adv[:, 0].tolist() == pytest.approx(want, rel=1e-9)
    dr, _ = get_advantage("drgrpo")(token_rewards=r, response_mask=m, index=idx)
    assert dr[:, 1].tolist() == pytest.approx([-0.5e-7, 0.5e-7, 1.0, -1.0], rel=1e-9)


@pytest.mark.parametrize("seed", [3, 4])
def test_grpo_rloo_against_loop(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 12, 5
    scores = torch.randn(B, generator=g, dtype=F64)
    index = torch.randint(0, 4, (B,), generator=g)
    index[0] = 99  # a singleton group
    mask = torch.ones(B, T, dtype=F64)
    mask[1, 2:] = 0
    r = A.scores_to_token_rewards(scores, mask)
    members = group_members(index.tolist())
    s = scores.tolist()
    grpo, rloo, dr = [], [], []
    for i in range(B):
        grp = [s[j] for j in members[i]]
        if len(grp) < 2:
            grpo.append(0.0), rloo.append(0.0), dr.append(0.0)
            continue
        grpo.append((s[i] - statistics.mean(grp)) / (statistics.stdev(grp) + 1e-6))
        dr.append(s[i] - statistics.mean(grp))
        rloo.append(s[i] - statistics.mean([s[j] for j in members[i] if j != i]))
    for name, exp in [("grpo", grpo), ("drgrpo", dr), ("rloo", rloo)]:
        adv, _ = get_advantage(name)(token_rewards=r, response_mask=mask, index=index)
        assert_matches(adv, [[exp[i]] * int(mask[i].sum()) for i in range(B)], mask)


def test_rloo_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 4.0, 7.0])
    idx = torch.tensor([0, 0, 0, 1, 2])
    m = torch.ones(5, 2)
    adv, _ = A.compute_rloo_advantage(token_rewards=A.scores_to_token_rewards(scores, m), response_mask=m, index=idx)
    # group 0: 1 - 0 = 1; 0 - (1+0)/2 = -0.5 ; groups 1, 2 have size 1 -> 0
    assert adv[:, 0].tolist() == pytest.approx([1.0, -0.5, -0.5, 0.0, 0.0])
    assert (adv[3:] == 0).all()


# ----------------------------------------------------------------------------- REINFORCE++ / ReMax


def test_reinforce_plus_plus_against_loop():
    rewards, _, mask = random_batch(5)
    expected_returns = ref_returns(rewards.tolist(), mask, 0.95)
    adv, ret = A.compute_reinforce_plus_plus_advantage(token_rewards=rewards, response_mask=mask, gamma=0.95)
    assert_matches(ret, expected_returns, mask)
    assert_matches(adv, ref_whiten(expected_returns), mask)


def test_reinforce_plus_plus_by_hand():
    r = torch.tensor([[0.0, 1.0], [0.0, 0.0], [3.0, 0.0]], dtype=F64)
    m = torch.tensor([[1, 1], [1, 1], [1, 0]])
    adv, ret = A.compute_reinforce_plus_plus_advantage(token_rewards=r, response_mask=m, gamma=0.5)
    assert ret.tolist() == [[0.5, 1.0], [0.0, 0.0], [3.0, 0.0]]
    vals = [0.5, 1.0, 0.0, 0.0, 3.0]
    mu, sd = statistics.mean(vals), statistics.stdev(vals)
    assert adv[0, 0].item() == pytest.approx((0.5 - mu) / sd, rel=1e-6)
    assert adv[2, 0].item() == pytest.approx((3.0 - mu) / sd, rel=1e-6)
    assert adv[2, 1].item() == 0.0


def test_reinforce_plus_plus_baseline_by_hand():
    scores = torch.tensor([2.0, 0.0, 1.0, 9.0], dtype=F64)
    idx = torch.tensor([0, 0, 1, 2])  # groups 1 and 2 are singletons
    m = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    r = A.scores_to_token_rewards(scores, m)
    adv, ret = get_advantage("reinforce_plus_plus_baseline")(token_rewards=r, response_mask=m, index=idx)
    # centred: +1 on two tokens, -1 on one token; whitened over those three tokens only.
    assert ret.tolist() == [[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0], [0.0] * 3, [0.0] * 3]
    vals = [1.0, 1.0, -1.0]
    mu, sd = statistics.mean(vals), statistics.stdev(vals)
    assert adv[0, 0].item() == pytest.approx((1 - mu) / sd, rel=1e-6)
    assert adv[1, 0].item() == pytest.approx((-1 - mu) / sd, rel=1e-6)
    assert (adv[2:] == 0).all() and adv[0, 2] == 0 and (adv[1, 1:] == 0).all()


def test_remax_by_hand():
    r = torch.tensor([[0.0, -0.1, 1.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    base = torch.tensor([0.4, 0.5, 1.0])
    adv, ret = A.compute_remax_advantage(token_rewards=r, response_mask=m, baseline_rewards=base)
    assert torch.allclose(ret, torch.tensor([[0.9, 0.9, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert torch.allclose(adv, torch.tensor([[0.5, 0.5, 0.6], [-0.5, -0.5, 0.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="baseline_rewards"):
        A.compute_remax_advantage(token_rewards=r, response_mask=m, baseline_rewards=torch.zeros(2))


# ----------------------------------------------------------------------------- PRIME


def test_implicit_process_rewards():
    prm = torch.tensor([[-1.0, -2.0], [-0.5, float("nan")]])
    ref = torch.tensor([[-1.5, -1.0], [-0.5, 0.0]])
    m = torch.tensor([[1, 1], [1, 0]])
    out = A.implicit_process_rewards(prm, ref, m, beta=0.05)
    assert torch.allclose(out, torch.tensor([[0.025, -0.05], [0.0, 0.0]]))


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_prime_against_paper_formula_loop(gamma):
    g = torch.Generator().manual_seed(6)
    B, T = 9, 6
    _, _, mask = random_batch(7, B, T)
    process = torch.randn(B, T, generator=g, dtype=F64)
    scores = torch.randn(B, generator=g, dtype=F64)
    index = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3])  # sample 0 is empty; group 3 is a singleton
    r = A.scores_to_token_rewards(scores, mask)
    outcome = A.sequence_scores(r, mask).tolist()  # the empty row's score cannot be placed: 0
    members = group_members(index.tolist())
    proc_rows = [[process[i, t].item() for t in idx] for i, idx in enumerate(rows(mask))]
    rbar = [statistics.mean(p) if p else 0.0 for p in proc_rows]
    expected = []
    for i in range(B):
        others = [j for j in members[i] if j != i]
        if not others:
            expected.append([0.0] * len(proc_rows[i]))
            continue
        base_p = sum(rbar[j] for j in others) / len(others)
        base_o = sum(outcome[j] for j in others) / len(others)
        shifted = [x - base_p for x in proc_rows[i]]
        ret = ref_returns([shifted], torch.ones(1, len(shifted)), gamma)[0]
        expected.append([2.0 * x + 0.5 * (outcome[i] - base_o) for x in ret])
    process_g = process.clone()
    process_g[mask == 0] = float("nan")
    adv, ret = get_advantage("prime")(
        token_rewards=r, response_mask=mask, index=index, process_rewards=process_g,
        gamma=gamma, process_coef=2.0, outcome_coef=0.5,
    )
    assert_matches(adv, expected, mask)
    assert torch.equal(ret, adv)
    adv_w, _ = A.compute_prime_advantage(
        token_rewards=r, response_mask=mask, index=index, process_rewards=process,
        gamma=gamma, process_coef=2.0, outcome_coef=0.5, whiten=True,
    )
    kept = [row for i, row in enumerate(expected) if len(members[i]) > 1]
    w = iter(ref_whiten(kept))
    assert_matches(adv_w, [next(w) if len(members[i]) > 1 else [0.0] * len(expected[i]) for i in range(B)], mask)


# ----------------------------------------------------------------------------- edge cases for all


def call(name, r, m, idx, v, pr, base):
    kw = {"token_rewards": r, "response_mask": m}
    if name in ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline", "prime"):
        kw["index"] = idx
    if name == "gae":
        kw["values"] = v
    if name == "prime":
        kw["process_rewards"] = pr
    if name == "remax":
        kw["baseline_rewards"] = base
    return get_advantage(name)(**kw)


ALL = ["gae", "grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "prime"]


@pytest.mark.parametrize("name", ALL)
def test_edge_cases_no_nan_and_zero_padding(name):
    m = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.float32)
    r = torch.tensor([[0, 1.0, float("nan")], [float("inf")] * 3, [0, 0, 2.0], [3.0, 0, 0], [0, 0, 0]])
    idx = torch.tensor([0, 0, 0, 1, 2])  # sample 3: singleton with a response; 4: singleton, all padding
    v = torch.full((5, 3), float("nan"))
    v[m.bool()] = 0.5
    pr = torch.where(m.bool(), torch.tensor(0.1), torch.tensor(float("nan")))
    adv, ret = call(name, r, m, idx, v, pr, torch.ones(5))
    for t in (adv, ret):
        assert t.shape == m.shape and t.dtype == torch.float32
        assert torch.isfinite(t).all(), t
        assert (t[m == 0] == 0).all()
    if name in ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline", "prime"):
        assert (adv[3] == 0).all()  # group of size 1


@pytest.mark.parametrize("name", ALL)
def test_all_padding_batch(name):
    m = torch.zeros(3, 4)
    z = torch.zeros(3, 4)
    adv, ret = call(name, z, m, torch.tensor([0, 0, 1]), z, z, torch.zeros(3))
    assert torch.equal(adv, z) and torch.equal(ret, z)


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline", "prime"])
def test_zero_std_groups_exactly_zero(name):
    # fp32 values whose group mean comes out one rounding step off (checked below), so
    # "score - mean" is tiny but nonzero and dividing it by std + eps would amplify it.
    scores = torch.tensor([67 / 97] * 3 + [17 / 97] * 7)
    index = torch.tensor([0] * 3 + [1] * 7)
    st = A.group_stats(scores, index)
    assert (st.mean != scores).all() and (st.std > 0).all()
    m = torch.ones(10, 2)
    r = A.scores_to_token_rewards(scores, m)
    adv, _ = call(name, r, m, index, None, torch.zeros(10, 2), None)
    assert (adv == 0).all(), adv


def test_no_gradient_leaks_into_advantages():
    v = torch.randn(2, 3, requires_grad=True)
    r = torch.randn(2, 3, requires_grad=True)
    adv, ret = A.compute_gae_advantage(token_rewards=r, response_mask=torch.ones(2, 3), values=v)
    assert not adv.requires_grad and not ret.requires_grad


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="shape"):
        A.compute_gae_advantage(
            token_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 3), values=torch.zeros(2, 1)
        )
    with pytest.raises(ValueError, match="shape"):
        A.compute_grpo_outcome_advantage(
            token_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 4), index=torch.tensor([0, 0])
        )
