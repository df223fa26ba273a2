import re

import pytest
import torch

import megarl.algorithms as alg
from megarl.algorithms import registry


@pytest.fixture
def clean_registry():
    adv, pol = dict(registry._ADVANTAGES), dict(registry._POLICY_LOSSES)
    yield
    registry._ADVANTAGES.clear(), registry._ADVANTAGES.update(adv)
    registry._POLICY_LOSSES.clear(), registry._POLICY_LOSSES.update(pol)


def test_builtins_are_registered_under_their_names():
    assert alg.get_advantage("gae") is alg.compute_gae_advantage
    assert alg.get_advantage("grpo") is alg.compute_grpo_outcome_advantage
    assert alg.get_advantage("drgrpo") is alg.compute_drgrpo_outcome_advantage
    assert alg.get_advantage("rloo") is alg.compute_rloo_advantage
    assert alg.get_advantage("reinforce_plus_plus") is alg.compute_reinforce_plus_plus_advantage
    assert alg.get_advantage("reinforce_plus_plus_baseline") is alg.compute_reinforce_plus_plus_baseline_advantage
    assert alg.get_advantage("remax") is alg.compute_remax_advantage
    assert alg.get_advantage("prime") is alg.compute_prime_advantage
    assert alg.get_policy_loss("ppo") is alg.ppo_policy_loss
    assert alg.get_policy_loss("gspo") is alg.gspo_policy_loss
    assert alg.get_policy_loss("vanilla") is alg.vanilla_policy_loss


def test_unknown_name_lists_registered_names():
    with pytest.raises(ValueError) as e:
        alg.get_advantage("grpo2")
    builtins = ["gae", "grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "prime"]
    for name in builtins:
        assert repr(name) in str(e.value)
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo2'.*'gspo', 'ppo', 'sft', 'vanilla'"):
        alg.get_policy_loss("ppo2")


def test_user_registration_duplicate_and_override(clean_registry):
    @alg.register_policy_loss("neg_mean_adv")
    def neg_mean_adv(*, logp, advantages, response_mask, **_):
        loss = alg.agg_loss(-advantages * logp, response_mask)
        return loss, {}

    assert alg.get_policy_loss("neg_mean_adv") is neg_mean_adv
    assert "neg_mean_adv" in alg.list_policy_losses()
    with pytest.raises(ValueError, match="already registered"):
        alg.register_policy_loss("neg_mean_adv")(lambda **kw: None)
    with pytest.raises(ValueError, match="already registered"):
        alg.register_advantage("grpo")(lambda **kw: None)
    replacement = alg.register_policy_loss("neg_mean_adv", override=True)(lambda **kw: (torch.zeros(()), {}))
    assert alg.get_policy_loss("neg_mean_adv") is replacement
    with pytest.raises(ValueError, match="non-empty"):
        alg.register_advantage("")


def test_registry_docstring_example_runs(clean_registry):
    # The example in registry.py's docstring must keep working.
    doc = registry.__doc__
    block = doc[doc.index("Adding your own takes a few lines::") :].split("::", 1)[1]
    lines = []
    for line in block.splitlines()[1:]:
        if line and not line.startswith("    "):
            break
        lines.append(line[4:])
    code = "\n".join(lines)
    assert "register_advantage" in code
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    r = torch.tensor([[0.0, 3.0, 0.0], [1.0, 0.0, 0.0]])
    ns = {"r": r, "m": m}
    exec(code, ns)
    assert torch.allclose(ns["adv"], torch.tensor([[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]]))
    name = re.search(r'register_advantage\("(\w+)", inputs=', code).group(1)
    assert name in alg.list_advantages()
    spec = alg.advantage_spec(name)
    assert spec.inputs == ("index",) and spec.needs_groups and not spec.needs_critic


def test_builtins_declare_what_they_take_and_need():
    spec = alg.advantage_spec
    assert spec("gae").inputs == ("values", "gamma", "lam") and spec("gae").needs_critic
    assert not spec("gae").needs_groups
    for name in ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline", "prime"):
        assert spec(name).needs_groups and "index" in spec(name).inputs and not spec(name).needs_critic
    assert spec("grpo").inputs == ("index", "norm_by_std")
    assert spec("reinforce_plus_plus").inputs == ("gamma",) and not spec("reinforce_plus_plus").needs_groups
    assert spec("remax").inputs == ("baseline_rewards",)
    assert alg.policy_loss_spec("ppo").options == ("clip_low", "clip_high", "clip_ratio_c")
    assert alg.policy_loss_spec("gspo").options == ("clip_low", "clip_high")
    assert alg.policy_loss_spec("vanilla").options == ()


def test_an_estimator_gets_exactly_its_declared_inputs():
    m = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    r = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 3.0], [0.0, 1.0]])
    offered = dict(index=["a", "a", "b", "b"], values=None, gamma=0.5, lam=0.9, norm_by_std=False)
    adv, _ = alg.advantage_spec("grpo")(token_rewards=r, response_mask=m, **offered)
    expected, _ = alg.compute_grpo_outcome_advantage(token_rewards=r, response_mask=m, index=offered["index"],
                                                     norm_by_std=False)
    assert torch.equal(adv, expected) and torch.equal(adv[:, 0], torch.tensor([0.5, -0.5, 1.0, -1.0]))


def test_a_caller_lacking_a_declared_input_gets_the_estimator_and_input_named():
    m, r = torch.ones(2, 2), torch.zeros(2, 2)
    # no critic in this run: the trainer offers values=None
    with pytest.raises(ValueError, match=r"advantage estimator 'gae' needs input\(s\) \['values'\]"):
        alg.advantage_spec("gae")(token_rewards=r, response_mask=m, index=["a", "b"], values=None, gamma=1.0,
                                  lam=1.0, norm_by_std=True)
    with pytest.raises(ValueError, match=r"'remax' needs input\(s\) \['baseline_rewards'\]"):
        alg.advantage_spec("remax")(token_rewards=r, response_mask=m, index=["a", "b"], gamma=1.0)
    with pytest.raises(ValueError, match=r"policy loss 'ppo' takes option\(s\) \['clip_ratio_c'\]"):
        alg.policy_loss_spec("ppo")(logp=r, old_logp=r, advantages=r, response_mask=m, loss_agg_mode="token-mean",
                                    max_len=None, clip_low=0.2, clip_high=None)


def test_a_declared_input_the_function_lacks_is_refused_at_registration(clean_registry):
    with pytest.raises(ValueError, match=r"'needs_lam' declares input\(s\) \['lam'\] that .*does not accept"):
        @alg.register_advantage("needs_lam", inputs=("gamma", "lam"))
        def needs_lam(*, token_rewards, response_mask, gamma):
            return token_rewards, token_rewards
    assert "needs_lam" not in alg.list_advantages()
    with pytest.raises(ValueError, match=r"'typo': unknown input\(s\) \['indx'\]"):
        alg.register_advantage("typo", inputs=("indx",))(lambda **kw: None)
    with pytest.raises(ValueError, match=r"policy loss 'clipless'.*\['clip_low'\]"):
        @alg.register_policy_loss("clipless", options=("clip_low",))
        def clipless(*, logp, old_logp, advantages, response_mask, loss_agg_mode, max_len):
            return logp.sum(), {}


def test_policy_loss_options_set_to_none_keep_the_default(clean_registry):
    seen = {}

    @alg.register_policy_loss("records", options=("clip_low", "clip_high"))
    def records(*, logp, old_logp, advantages, response_mask, loss_agg_mode, max_len, clip_low, clip_high=0.5):
        seen.update(clip_low=clip_low, clip_high=clip_high, max_len=max_len)
        return logp.sum(), {}

    x = torch.zeros(1, 2)
    alg.policy_loss_spec("records")(logp=x, old_logp=x, advantages=x, response_mask=x, loss_agg_mode="token-mean",
                                    max_len=7, clip_low=0.1, clip_high=None, clip_ratio_c=3.0)
    assert seen == {"clip_low": 0.1, "clip_high": 0.5, "max_len": 7}  # clip_ratio_c: not declared, not passed
