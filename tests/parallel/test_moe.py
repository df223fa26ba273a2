"""Megatron MoE trains on CPU over gloo the same at every expert layout.

Oracle: every layout holds the same model (loaded from one HF checkpoint) and takes the same global
batches, so its per-step losses and grad norms (the load-balancing loss on, as the Qwen3-MoE preset
configures it) must equal the single-rank run's, as tests/parallel/test_megatron_cpu.py checks for
dense models.
"""

import pytest

from megarl.pretrain_demo import DemoRun, train_on_rank
from parallel.layout import MegatronLayout
from parallel.spawn import run_on_ranks
from tests.parallel.test_megatron_cpu import last_stage_losses

SP = {"tp": 2, "sequence_parallel": True}
LAYOUTS = {
    "ep1": (MegatronLayout(), 1),
    "ep2": (MegatronLayout(ep=2), 2),
    "ep2_tp2": (MegatronLayout(ep=2, **SP), 2),
    "ep2_tp2_etp2": (MegatronLayout(ep=2, etp=2, **SP), 4),
    "ep2_pp2": (MegatronLayout(ep=2, pp=2), 4),
    "ep2_pp2_vpp2": (MegatronLayout(ep=2, pp=2, vpp=2), 4),
}


@pytest.fixture(scope="module")
def histories(tiny_hf_model):
    """layout -> per-rank histories of 4 Adam steps of the tiny Qwen3-MoE (aux loss 0.01). Its vocab
    is one that megatron pads to the same size at TP 1 and 2: the demo's cross entropy runs over the
    padded vocab (zero rows, logit 0), so another padding is another loss."""
    hf_dir = tiny_hf_model("tiny-qwen3-moe", seed=5, vocab_size=256)
    runs = {name: run_on_ranks(train_on_rank, world, DemoRun(layout=layout, steps=4, hf_dir=hf_dir), timeout_s=240)
            for name, (layout, world) in LAYOUTS.items()}
    without_aux = tiny_hf_model("tiny-qwen3-moe", seed=5, vocab_size=256, output_router_logits=False)
    runs["ep1_without_aux"] = run_on_ranks(train_on_rank, 1, DemoRun(steps=1, hf_dir=without_aux), timeout_s=240)
    return runs


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_trains_like_single_rank(histories, name):
    reference = histories["ep1"][0]
    losses = last_stage_losses(histories[name])
    assert all(step["update_successful"] for h in histories[name] for step in h)
    assert losses[-1] < losses[0], f"{name}: loss did not fall: {losses}"
    assert losses == pytest.approx([s["loss"] for s in reference], rel=1e-4), name
    for history in histories[name]:  # every rank agrees on the grad norm, experts included
        norms = [s["grad_norm"] for s in history]
        assert norms[0] == pytest.approx(reference[0]["grad_norm"], rel=1e-5), name
        assert norms == pytest.approx([s["grad_norm"] for s in reference], rel=5e-3), name


def test_load_balancing_loss_is_in_the_gradient(histories):
    """The same weights and batch without HF's output_router_logits (no aux loss): the first loss
    is the same, the gradient is not."""
    with_aux, without = histories["ep1"][0][0], histories["ep1_without_aux"][0][0]
    assert without["loss"] == with_aux["loss"]
    assert without["grad_norm"] != pytest.approx(with_aux["grad_norm"], rel=1e-4)
