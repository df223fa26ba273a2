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
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo2'.*'gspo', 'ppo', 'vanilla'"):
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
    name = re.search(r'register_advantage\("(\w+)"\)', code).group(1)
    assert name in alg.list_advantages()
