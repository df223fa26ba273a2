"""MoE families (Qwen3-MoE, Mixtral): their weight rules name exactly the tensors HF transformers
saves, their TransformerConfig routes as HF does, and unsupported MoE features are refused by name."""

import pytest
import torch

from model_specs import UnsupportedModelError, family_for
from model_specs.presets import hf_config_dict
from parallel.layout import LayoutError, MegatronLayout
from parallel.shards import check_coverage, hf_tensor_shapes, megatron_positions, megatron_shards

MOE_PRESETS = ("tiny-qwen3-moe", "tiny-mixtral")


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_rules_name_every_tensor_hf_transformers_saves_with_its_shape(tiny_hf_model, preset):
    from parallel.checkpoint.hf_io import HFCheckpoint

    saved = HFCheckpoint(tiny_hf_model(preset, seed=5), check_tensors=False)
    shapes = hf_tensor_shapes(saved.config)
    assert sorted(shapes) == sorted(saved.names)
    assert all(tuple(saved.shape(name)) == shape for name, shape in shapes.items())


@pytest.mark.parametrize("preset", MOE_PRESETS)
@pytest.mark.parametrize("layout", [MegatronLayout(), MegatronLayout(ep=2), MegatronLayout(ep=4, pp=2),
                                    MegatronLayout(tp=2, ep=2, etp=2, sequence_parallel=True),
                                    MegatronLayout(tp=2, ep=2, sequence_parallel=True)])
def test_every_expert_element_is_held_once_per_replica(preset, layout):
    """Across the model positions of a layout, each element of every HF tensor is covered, the
    experts exactly once (each EP rank its own experts, each ETP rank its share of them)."""
    hf = hf_config_dict(preset)
    shapes = hf_tensor_shapes(hf)
    covered = {name: torch.zeros(shape, dtype=torch.int32) for name, shape in shapes.items()}
    shards = megatron_shards(hf, layout)
    assert list(shards) == megatron_positions(layout)
    for chunks in shards.values():
        for tensors in chunks:
            for tensor in tensors.values():
                check_coverage(tensor)
                for piece in tensor.pieces:
                    if piece.hf is not None:
                        covered[piece.hf][tuple(slice(a, b) for a, b in piece.src)] += 1
    for name, count in covered.items():
        assert count.min() >= 1, name
        if ".experts." in name:  # replicated only across the dense TP ranks that share an expert rank
            assert int(count.max()) == int(count.min()) == len(shards) // layout.pp // (layout.ep * layout.etp), name


@pytest.mark.parametrize("preset, norm_topk_prob, pre_softmax", [
    ("tiny-qwen3-moe", True, False), ("tiny-qwen3-moe", False, True), ("tiny-mixtral", None, False)])
def test_router_config_follows_hf_routing(preset, norm_topk_prob, pre_softmax):
    """HF's renormalised top-k probabilities are megatron's softmax over the top-k logits
    (pre_softmax off); unnormalised ones its softmax-then-top-k. No token is ever dropped."""
    hf = hf_config_dict(preset, **({} if norm_topk_prob is None else {"norm_topk_prob": norm_topk_prob}))
    kwargs = family_for(hf).transformer_config_kwargs(hf)
    assert kwargs["moe_router_pre_softmax"] is pre_softmax
    assert kwargs["num_moe_experts"] == 4 and kwargs["moe_router_topk"] == 2
    assert kwargs["moe_expert_capacity_factor"] is None
    assert "moe_token_dispatcher_type" not in kwargs  # the run's choice (parallel.models.build_model_chunks)
    aux = hf.get("router_aux_loss_coef") if hf.get("output_router_logits") else 0.0
    assert kwargs["moe_aux_loss_coeff"] == aux


@pytest.mark.parametrize("preset, override, message", [
    ("tiny-qwen3-moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ("tiny-qwen3-moe", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]"),
    ("tiny-qwen3-moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size=64.*shared experts"),
    ("tiny-qwen3-moe", {"kv_lora_rank": 16}, "kv_lora_rank=16.*MLA"),
    ("tiny-qwen3-moe", {"scoring_func": "sigmoid"}, "scoring_func='sigmoid'.*sigmoid routers"),
    ("tiny-qwen3-moe", {"num_experts_per_tok": 8}, "num_experts_per_tok=8"),
    ("tiny-mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ("tiny-mixtral", {"model_type": "deepseek_v3"}, "deepseek_v3.*sigmoid router"),
    ("tiny-mixtral", {"model_type": "qwen2_moe"}, "qwen2_moe.*shared experts"),
])
def test_unsupported_moe_configs_name_the_field(preset, override, message):
    hf = hf_config_dict(preset, **override)
    with pytest.raises(UnsupportedModelError, match=message):
        family_for(hf).transformer_config_kwargs(hf)


@pytest.mark.parametrize("layout, world, hf_preset, message", [
    (MegatronLayout(ep=3), 3, "tiny-qwen3-moe", "ep=3 must divide num_experts=4"),
    (MegatronLayout(ep=2), 1, "tiny-qwen3-moe", "ep\\*etp=2\\*1 must divide"),
    (MegatronLayout(ep=2), 2, "tiny-llama", "need an MoE model"),
    (MegatronLayout(tp=2, ep=2), 2, "tiny-qwen3-moe", "sequence_parallel"),
])
def test_expert_layouts_are_validated(layout, world, hf_preset, message):
    with pytest.raises(LayoutError, match=message):
        layout.validate(world, hf_config_dict(hf_preset))


def test_moe_refuses_the_te_layer_spec_until_mapped():
    hf = hf_config_dict("tiny-mixtral")
    with pytest.raises(ValueError, match="layer_spec='te' is not mapped for MoE"):
        family_for(hf).weight_rules(hf, "te")


def test_moe_builds_default_to_the_local_spec_where_te_imports(monkeypatch):
    import sys
    import types

    from parallel.models import default_layer_spec

    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    assert default_layer_spec(hf_config_dict("tiny-llama")) == "te"
    assert default_layer_spec(hf_config_dict("tiny-mixtral")) == "local"
