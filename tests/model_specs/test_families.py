"""Model families map HF configs onto megatron's TransformerConfig, and refuse what they can't map."""

import pytest

from model_specs import UnsupportedModelError, family_for, padded_vocab_size
from model_specs.presets import TINY_PRESETS, hf_config_dict, make_hf_config


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_tiny_presets_map_to_megatron(preset):
    hf = hf_config_dict(preset)
    kwargs = family_for(hf).transformer_config_kwargs(hf)
    assert kwargs["num_query_groups"] == hf["num_key_value_heads"]
    assert kwargs["kv_channels"] == hf["head_dim"]
    assert kwargs["add_qkv_bias"] == (hf["model_type"] == "qwen2")
    assert kwargs["qk_layernorm"] == (hf["model_type"] in ("qwen3", "qwen3_moe"))
    # The HF model built from the same preset agrees on what the parameters are.
    config = make_hf_config(preset)
    assert config.num_key_value_heads == kwargs["num_query_groups"]
    assert config.tie_word_embeddings == family_for(hf).gpt_model_kwargs(hf)["share_embeddings_and_output_weights"]


def test_presets_cover_the_cases_parallel_code_must_get_right():
    configs = [hf_config_dict(p) for p in TINY_PRESETS]
    assert {c["tie_word_embeddings"] for c in configs} == {True, False}
    assert {c["vocab_size"] % 64 == 0 for c in configs} == {True, False}
    assert {c["num_key_value_heads"] for c in configs} >= {1, 2}
    assert {c["model_type"] for c in configs} == {"llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral"}


def test_vocab_padding_matches_megatron_rule():
    assert padded_vocab_size(200, 128, 1) == 256
    assert padded_vocab_size(256, 128, 2) == 256
    assert padded_vocab_size(257, 128, 2) == 512
    assert padded_vocab_size(151936, 128, 4) == 152064


@pytest.mark.parametrize(
    "override, message",
    [
        ({"model_type": "gpt2"}, "supported model types"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}, "rope_type='dynamic' is not supported"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"sliding_window_pattern": 2}, "sliding_window_pattern"),
        ({"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768}, "sliding_window=4096"),
        ({"model_type": "mistral", "sliding_window": 16}, "sliding_window=16"),  # HF's default context is longer
        ({"model_type": "qwen3", "use_sliding_window": True}, "use_sliding_window=True"),
    ],
)
def test_unsupported_configs_name_the_field(override, message):
    hf = hf_config_dict("tiny-llama", **override)
    with pytest.raises(UnsupportedModelError, match=message):
        family_for(hf).transformer_config_kwargs(hf)


def test_te_layer_spec_renames_the_two_fused_norms_and_nothing_else():
    """Transformer Engine's spec fuses the pre-attention / pre-MLP norms into linear_qkv / linear_fc1;
    the weight rules differ from the local spec's in those two Megatron names only (the tensors
    are proven against mbridge in tests/parallel/checkpoint/test_te_names.py)."""
    import dataclasses

    from model_specs import QWEN3, layer_spec_of, megatron_name

    hf = hf_config_dict("tiny-qwen3")
    local, te = QWEN3.weight_rules(hf), QWEN3.weight_rules(hf, "te")
    assert [dataclasses.replace(rule, megatron=other.megatron) for rule, other in zip(local, te, strict=True)] == te
    assert {(a.megatron, b.megatron) for a, b in zip(local, te) if a != b} == {
        ("decoder.layers.{layer}.input_layernorm.weight", "decoder.layers.{layer}.self_attention.linear_qkv.layer_norm_weight"),
        ("decoder.layers.{layer}.pre_mlp_layernorm.weight", "decoder.layers.{layer}.mlp.linear_fc1.layer_norm_weight"),
    }
    assert megatron_name("decoder.layers.7.input_layernorm.weight", "local") == "decoder.layers.7.input_layernorm.weight"
    assert layer_spec_of(megatron_name(r.megatron, "te") for r in local) == "te"
    assert layer_spec_of(r.megatron for r in local) == layer_spec_of(["embedding.word_embeddings.weight"]) == "local"
    with pytest.raises(ValueError, match=r"layer_spec='TE' is not a layer spec megarl maps; use one of \['local', 'te'\]"):
        QWEN3.weight_rules(hf, "TE")
