"""model_specs.arithmetic against its oracles: HF transformers' models built from the same config
(``numel`` for parameters, torch's FlopCounterMode over a forward pass for FLOPs), hand counts,
and the published sizes of Qwen3-MoE, Mixtral, Llama-3-70B and DeepSeek-V3."""

from __future__ import annotations

import pytest
import torch

from model_specs.arithmetic import (
    active_parameters,
    forward_flops,
    forward_flops_per_token,
    is_moe_layer,
    parameter_counts,
    total_parameters,
)
from model_specs.presets import PRESETS, hf_config_dict

# Shapes megarl does not build yet, counted all the same: DeepSeek-V3's (multi-latent attention
# with a q_lora_rank bottleneck, a shared expert, the first layer dense) and Qwen2-MoE's (a shared
# expert with its gate, decoder_sparse_step=2 and one mlp_only_layer: dense and MoE layers mixed).
TINY_DEEPSEEK_V3 = dict(model_type="deepseek_v3", vocab_size=256, hidden_size=64, intermediate_size=96,
                        moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                        n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, n_group=2, topk_group=1,
                        first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=12, tie_word_embeddings=False)
TINY_QWEN2_MOE = dict(model_type="qwen2_moe", vocab_size=256, hidden_size=64, intermediate_size=96,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                      decoder_sparse_step=2, mlp_only_layers=[3], tie_word_embeddings=True)
UNBUILT = {
    "tiny-deepseek-v3": TINY_DEEPSEEK_V3,
    # no q bottleneck (DeepSeek-V2-Lite style) and biased attention projections
    "tiny-deepseek-v3-no-q-lora": dict(TINY_DEEPSEEK_V3, q_lora_rank=None, attention_bias=True),
    "tiny-qwen2-moe": TINY_QWEN2_MOE,
}
SMALL = {**{name: hf_config_dict(name) for name in PRESETS if name.startswith(("tiny-", "bench-qwen2"))}, **UNBUILT}

# Published configs (config.json values) of models with no preset.
MIXTRAL_8X7B = dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                    num_experts_per_tok=2, tie_word_embeddings=False)
DEEPSEEK_V3 = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                   moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                   n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
                   moe_layer_freq=1, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                   v_head_dim=128, attention_bias=False, tie_word_embeddings=False, num_nextn_predict_layers=1)


def _hf_model(hf: dict, device: str = "cpu", auto=None):
    """The HF model of ``hf`` (eager attention and experts: plain matmuls the FLOP counter sees)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(hf)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device(device):
        return (auto or AutoModelForCausalLM).from_config(config, attn_implementation="eager",
                                                          experts_implementation="eager")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_total_parameters_equal_the_hf_model_of_every_preset(preset):
    hf = hf_config_dict(preset)
    model = _hf_model(hf, device="meta")  # shapes only: the 235B preset too
    assert total_parameters(hf) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(UNBUILT))
def test_total_parameters_equal_the_hf_model_of_unbuilt_shapes(name):
    """MLA (with and without the q bottleneck), shared experts, dense layers among MoE ones."""
    assert total_parameters(UNBUILT[name]) == sum(p.numel() for p in _hf_model(UNBUILT[name]).parameters())


def test_reward_model_counts_its_score_head():
    from transformers import AutoModelForSequenceClassification

    hf = hf_config_dict("tiny-qwen2", architectures=["Qwen2ForSequenceClassification"], id2label={0: "LABEL_0"})
    model = _hf_model(hf, auto=AutoModelForSequenceClassification)
    assert parameter_counts(hf).output_layer == 64  # score: hidden x 1 label, no lm_head
    assert total_parameters(hf) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(SMALL))
def test_forward_flops_equal_torch_flop_counter_on_the_hf_model(name):
    """torch's FlopCounterMode over an HF forward of S tokens counts every matmul: 2 x the active
    matmul weights per token (each token's top-k experts only, the output layer, no embedding)
    plus eager attention's full S x S scores and values (the causal mask is applied after the
    product; our causal count is the S (S + 1) / 2 keys actually attended)."""
    from torch.utils.flop_counter import FlopCounterMode

    hf, seq = SMALL[name], 7
    torch.manual_seed(0)
    model = _hf_model(hf)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(0, hf["vocab_size"], (1, seq)))
    counts = parameter_counts(hf)
    per_key = sum(layer.attention_flops_per_key for layer in counts.layers)
    assert counter.get_total_flops() == 2 * counts.active_matmul * seq + seq * seq * per_key
    assert forward_flops(hf, [seq]) == 2 * counts.active_matmul * seq + seq * (seq + 1) // 2 * per_key


def test_tiny_moe_by_hand():
    """tiny-qwen3-moe: hidden 64, 4 layers, 4 query / 2 KV heads of 16, q/k norms, 4 experts of 32,
    top-2, vocab 300, untied."""
    hf = hf_config_dict("tiny-qwen3-moe")
    attention = 64 * (64 + 2 * 32) + 64 * 64  # q, k, v, o = 12288
    norms = 2 * 64 + 2 * 16  # input / post-attention norms, q / k norms
    router, expert = 4 * 64, 3 * 64 * 32  # 256, 6144
    vocab = 300 * 64  # 19200: embedding, and the output layer again
    assert total_parameters(hf) == 4 * (attention + norms + router + 4 * expert) + 2 * vocab + 64 == 187584
    assert active_parameters(hf) == 4 * (attention + norms + router + 2 * expert) + 2 * vocab + 64 == 138432
    # 2 x (attention + router + 2 experts per layer + output layer); no embedding, no norms
    assert forward_flops_per_token(hf) == 2 * (4 * (attention + router + 2 * expert) + vocab) == 237056
    # + per layer and key 2 x 4 heads x (16 + 16); a 9-token sequence attends 45 keys: 5 per token
    assert forward_flops_per_token(hf, 9) == 237056 + 4 * 2 * 4 * 32 * 5
    assert forward_flops(hf, [9, 3]) == 12 * 237056 + 4 * 2 * 4 * 32 * (45 + 6)


def test_tied_output_layer_is_one_parameter_but_still_a_product():
    tied, untied = hf_config_dict("tiny-llama-tied"), hf_config_dict("tiny-llama-tied", tie_word_embeddings=False)
    assert total_parameters(untied) - total_parameters(tied) == 256 * 64
    assert forward_flops_per_token(tied) == forward_flops_per_token(untied)


def test_moe_layers_follow_the_hf_modelling_code():
    assert [is_moe_layer(TINY_DEEPSEEK_V3, i) for i in range(4)] == [False, True, True, True]  # first_k_dense_replace
    assert [is_moe_layer(TINY_QWEN2_MOE, i) for i in range(4)] == [False, True, False, False]  # step 2, layer 3 dense
    assert not any(is_moe_layer(hf_config_dict("tiny-llama"), i) for i in range(4))


def _published(hf: dict, total: float, active: float, tolerance: float = 0.02) -> None:
    assert total_parameters(hf) == pytest.approx(total, rel=tolerance)
    assert active_parameters(hf) == pytest.approx(active, rel=tolerance)


def test_published_sizes():
    _published(hf_config_dict("qwen3-30b-a3b"), 30.5e9, 3.3e9)  # Qwen3-30B-A3B: 30.5B, 3.3B activated
    _published(hf_config_dict("qwen3-235b-a22b"), 235e9, 22e9)  # Qwen3-235B-A22B
    _published(MIXTRAL_8X7B, 46.7e9, 12.9e9)  # Mixtral-8x7B: 46.7B, 12.9B per token
    assert total_parameters(hf_config_dict("llama3-70b")) == active_parameters(hf_config_dict("llama3-70b")) \
        == 70_553_706_496  # Meta's 70.6B
    _published(DEEPSEEK_V3, 671e9, 37e9)  # DeepSeek-V3: 671B, 37B activated (MTP module excluded)


def test_deepseek_v3_by_hand():
    """DeepSeek-V3's config.json values counted out: MLA with 128 heads, 3 dense layers then 58 MoE
    layers of 256 routed experts (top-8) and 1 shared expert of 2048, vocab 129280 untied."""
    h, heads = 7168, 128
    mla = (h * 1536 + 1536 * heads * (128 + 64)  # q_a_proj, q_b_proj
           + h * (512 + 64) + 512 * heads * (128 + 128)  # kv_a_proj_with_mqa, kv_b_proj
           + heads * 128 * h)  # o_proj
    norms = 2 * h + 1536 + 512  # input / post-attention, q_a / kv_a layernorms
    dense, expert, router = 3 * h * 18432, 3 * h * 2048, 256 * h
    embeddings = 2 * 129280 * h + h  # embed_tokens, lm_head, final norm
    total = 61 * (mla + norms) + 3 * dense + 58 * (router + 257 * expert) + embeddings
    active = 61 * (mla + norms) + 3 * dense + 58 * (router + 9 * expert) + embeddings
    assert total_parameters(DEEPSEEK_V3) == total == 671_026_404_352
    assert active_parameters(DEEPSEEK_V3) == active == 37_552_282_624
    assert forward_flops_per_token(DEEPSEEK_V3) == 2 * (61 * mla + 3 * dense + 58 * (router + 9 * expert)
                                                        + 129280 * h)


def _old_dense_formula(hf: dict) -> float:
    """What megarl/trainer.py's _flops_per_token computed before model_specs.arithmetic."""
    h, f, layers, v = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"], hf["vocab_size"]
    kv = hf.get("num_key_value_heads", hf["num_attention_heads"]) * hf.get("head_dim", h // hf["num_attention_heads"])
    return 2.0 * (layers * (h * h * 2 + 2 * h * kv + 3 * h * f) + h * v)


def test_the_old_dense_formula_was_right_for_dense_presets_and_wrong_for_moe():
    for name in ("tiny-llama", "tiny-qwen2", "llama3-8b", "llama3-70b", "qwen2.5-7b"):
        assert _old_dense_formula(hf_config_dict(name)) == forward_flops_per_token(hf_config_dict(name)), name
    # Qwen3-30B-A3B: the dense intermediate size happens to equal 8 experts' worth (6144 = 8 x 768),
    # but it took q and o as hidden x hidden (4096 query channels, not 2048) and left out the router.
    ratio = {name: _old_dense_formula(hf) / forward_flops_per_token(hf) for name, hf in
             [("qwen3-30b-a3b", hf_config_dict("qwen3-30b-a3b")), ("qwen3-235b-a22b", hf_config_dict("qwen3-235b-a22b")),
              ("mixtral-8x7b", MIXTRAL_8X7B), ("tiny-qwen3-moe", hf_config_dict("tiny-qwen3-moe"))]}
    assert ratio["qwen3-30b-a3b"] == pytest.approx(0.863, abs=1e-3)  # 5.25 vs 6.08 GFLOP per token
    assert ratio["qwen3-235b-a22b"] == pytest.approx(0.851, abs=1e-3)
    assert ratio["mixtral-8x7b"] == pytest.approx(0.558, abs=1e-3)  # one expert of 14336 counted, not two
    assert ratio["tiny-qwen3-moe"] == pytest.approx(1.406, abs=1e-3)  # the dense 128 counted, not 2 x 32
