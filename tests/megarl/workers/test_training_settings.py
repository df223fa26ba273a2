"""How megatron trains (``actor.recompute``, ``actor.overlap_grad_reduce``, the MoE token
dispatcher, micro-batches of their own shape under pipelining, no random init before a load):
each setting reaches the model megatron builds and leaves the update what it is without it.
The oracle is the same update without the setting (the layout tests compare layouts)."""

import pytest
import torch

from parallel.spawn import run_on_ranks
from tests.megarl.workers.rank_fns import loaded_params_with_and_without_init, worker_update_with_settings
from tests.megarl.workers.test_megatron_worker import rollout_batch

KEYS = ("actor/loss", "actor/pg_loss", "actor/grad_norm")


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_model):
    return tiny_hf_model("tiny-llama", seed=1)  # vocab 200: padded to 256, not a multiple of 128 x tp


def _after(per_rank) -> torch.Tensor:
    """The actor's log-probs after the update, rows in batch order."""
    parts = [r["after"] for r in per_rank if r["after"] is not None]
    return torch.cat([p["logp"] for p in parts])[torch.cat([p["rows"] for p in parts]).argsort()]


def _same_update(got, want, rel=1e-6):
    for key in KEYS:
        assert got[-1]["metrics"][key] == pytest.approx(want[-1]["metrics"][key], rel=rel, abs=1e-7), key
    torch.testing.assert_close(_after(got), _after(want), atol=1e-6, rtol=0)


@pytest.mark.parametrize("layout, batching", [(dict(cp=2), {}), (dict(pp=2), {"shared_prompts": True})],
                         ids=["cp2", "shared_pp2"])
def test_recompute_gives_the_same_update(hf_dir, layout, batching):
    """Selective recompute re-runs each core attention in the backward, full recompute each layer;
    the update is the one without recompute (the context-parallel and shared-prefix attentions,
    whose masks selective recompute rebuilds, at cp=2 and under pipelining)."""
    batch = rollout_batch(200)
    runs = {recompute: run_on_ranks(worker_update_with_settings, 2, hf_dir, layout, batch,
                                    {"recompute": recompute}, batching, timeout_s=240)
            for recompute in ("none", "selective", "full")}
    for recompute, per_rank in runs.items():
        _same_update(per_rank, runs["none"])
        mine = per_rank[0]
        forwards = {kind: n // mine["micro_batches"] for kind, n in mine["calls"].items()}  # per micro-batch
        plain = {kind: n // mine["micro_batches"] for kind, n in runs["none"][0]["calls"].items()}
        assert forwards == {"layer": plain["layer"] * (2 if recompute == "full" else 1),
                            "core_attention": plain["core_attention"] * (1 if recompute == "none" else 2)}, recompute
        assert mine["built"]["recompute_granularity"] == {"none": None}.get(recompute, recompute)


@pytest.mark.parametrize("layout", [dict(), dict(use_distributed_optimizer=True)], ids=["dp2", "dp2_dist_opt"])
def test_overlapped_grad_reduce_gives_the_same_update(hf_dir, layout):
    """Data-parallel gradient reduction started during the backward (several micro-batches per
    replica: only the last one's backward starts it) gives the update of the reduction after it."""
    batch = rollout_batch(200)
    runs = {overlap: run_on_ranks(worker_update_with_settings, 2, hf_dir, layout, batch,
                                  {"overlap_grad_reduce": overlap}, timeout_s=240) for overlap in (False, True)}
    assert runs[True][0]["micro_batches"] > 1
    assert [r[0]["built"]["overlap_grad_reduce"] for r in runs.values()] == [False, True]
    _same_update(runs[True], runs[False])


def test_which_micro_batches_take_one_shape():
    """One shape for all: the allgather MoE dispatcher under pipelining or with an expert group
    across replicas, and the interleaved schedule on gloo (its batched shape exchange); otherwise
    each micro-batch its own (tests/parallel/modules/test_value_head.py's pp2_vpp2 hung on gloo)."""
    from parallel.layout import MegatronLayout as L
    from parallel.models import common_micro_batch_shape as common

    assert not common(L(pp=2), None) and not common(L(pp=2), "alltoall") and not common(L(ep=2), "alltoall")
    assert common(L(pp=2), "allgather") and common(L(ep=2), "allgather") and not common(L(tp=2, ep=2), "allgather")
    assert common(L(pp=2, vpp=2), None, gloo=True) and not common(L(pp=2, vpp=2), None, gloo=False)
    assert common(L(pp=2, vpp=2), None) == common(L(pp=2, vpp=2), None, gloo=not torch.cuda.is_available())
    with pytest.raises(ValueError, match="moe_token_dispatcher='flex'; use one of"):
        common(L(), "flex")


def test_micro_batches_keep_their_own_shape_under_pipelining(hf_dir):
    """Under pipelining each micro-batch is padded to its own longest row only (megatron's p2p
    sends its shape first: variable_seq_lengths); test_same_updates_at_every_layout is the
    oracle that the pipelined update is the unpipelined one."""
    batch = rollout_batch(200)
    per_rank = run_on_ranks(worker_update_with_settings, 2, hf_dir, dict(pp=2), batch, {}, timeout_s=240)
    built, shapes = per_rank[0]["built"], per_rank[0]["shapes"]
    assert built["variable_seq_lengths"] is True
    assert len(set(shapes)) > 1, shapes  # rows of different lengths: micro-batches of different shapes
    assert per_rank[0]["shapes"] == per_rank[1]["shapes"]


@pytest.mark.parametrize("layout, value_model", [(dict(tp=2), False), (dict(pp=2), False), (dict(tp=2), True)],
                         ids=["tp2", "pp2", "tp2_critic"])
def test_an_hf_load_writes_every_element_without_random_init(hf_dir, layout, value_model):
    """The worker builds its models without megatron's random init (an HF load follows): loading
    into uninitialised (here: all-NaN) chunks gives bit for bit the parameters of loading into
    initialised ones, so the load writes every element, the vocab rows megatron pads 200 to 256
    with included (a critic's value head is initialised after the load either way), and the
    parameters carry the same tensor-parallel tags (megatron's perform_initialization=False
    leaves them off: the gradient norm then counts a split weight's shards as copies)."""
    for rank, out in enumerate(run_on_ranks(loaded_params_with_and_without_init, 2, hf_dir, layout, value_model,
                                            timeout_s=240)):
        assert out[("tags", False)] == out[("tags", True)]
        assert any(tags["tensor_model_parallel"] for tags in out[("tags", True)].values())
        assert out[True].keys() == out[False].keys()
        for name, want in out[True].items():
            assert torch.equal(out[False][name], want), (rank, name)


def test_the_worker_builds_without_random_init_and_with_the_dispatcher(tiny_hf_model):
    """The worker's model carries the spec's MoE token dispatcher and no random init; with the
    allgather dispatcher an MoE model keeps one micro-batch shape under pipelining."""
    hf_dir = tiny_hf_model("tiny-qwen3-moe", seed=1)
    per_rank = run_on_ranks(worker_update_with_settings, 2, hf_dir, dict(pp=2), rollout_batch(300),
                            {"moe_token_dispatcher": "allgather"}, timeout_s=240)
    built = per_rank[0]["built"]
    assert built["moe_token_dispatcher_type"] == "allgather" and built["init_method"] == "_leave_as_allocated"
    assert built["variable_seq_lengths"] is False and len(set(per_rank[0]["shapes"])) == 1
