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
    assert kwargs["qk_layernorm"] == (hf["model_type"] == "qwen3")
    # The HF model built from the same preset agrees on what the parameters are.
    config = make_hf_config(preset)
    assert config.num_key_value_heads == kwargs["num_query_groups"]
    assert config.tie_word_embeddings == family_for(hf).gpt_model_kwargs(hf)["share_embeddings_and_output_weights"]


def test_presets_cover_the_cases_parallel_code_must_get_right():
    configs = [hf_config_dict(p) for p in TINY_PRESETS]
    assert {c["tie_word_embeddings"] for c in configs} == {True, False}
    assert {c["vocab_size"] % 64 == 0 for c in configs} == {True, False}
    assert {c["num_key_value_heads"] for c in configs} >= {1, 2}
    assert {c["model_type"] for c in configs} == {"llama", "qwen2", "qwen3", "mistral"}


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
