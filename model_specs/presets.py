"""Model size presets as data: tiny test models up to 70B-class shapes.

Tiny presets are built locally (no downloads) and cover what the parallel code must get right:
GQA, qkv bias, tied and untied embeddings, vocab sizes that are and are not multiples of 64.
Layer counts are multiples of 4 so PP=2 x VPP=2 splits evenly.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

_TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256,
    hidden_act="silu", initializer_range=0.02, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)

# What Qwen3-30B-A3B and Qwen3-235B-A22B share: 128 experts, top-8 renormalised, 4 KV heads of 128.
_QWEN3_MOE = dict(model_type="qwen3_moe", vocab_size=151936, num_key_value_heads=4, head_dim=128, num_experts=128,
                  num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                  router_aux_loss_coef=0.001, rms_norm_eps=1e-6, max_position_embeddings=40960, hidden_act="silu",
                  tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})

PRESETS: dict[str, dict[str, Any]] = {
    # Llama, untied, vocab 200 (not a multiple of 64: exercises padding everywhere).
    "tiny-llama": dict(_TINY, model_type="llama", vocab_size=200, tie_word_embeddings=False),
    # Llama, tied embeddings, vocab a multiple of 64.
    "tiny-llama-tied": dict(_TINY, model_type="llama", vocab_size=256, tie_word_embeddings=True),
    # Qwen2: qkv bias, tied, one KV head (KV replicated once TP > 1).
    "tiny-qwen2": dict(_TINY, model_type="qwen2", vocab_size=256, tie_word_embeddings=True,
                       num_key_value_heads=1),
    # Qwen2 untied with an odd vocab.
    "tiny-qwen2-untied": dict(_TINY, model_type="qwen2", vocab_size=250, tie_word_embeddings=False),
    # Qwen3: per-head q/k RMSNorm, untied, odd vocab.
    "tiny-qwen3": dict(_TINY, model_type="qwen3", vocab_size=300, tie_word_embeddings=False),
    # Mistral (no sliding window), tied.
    "tiny-mistral": dict(_TINY, model_type="mistral", vocab_size=256, tie_word_embeddings=True, sliding_window=None),
    # Qwen3-MoE: 4 experts, top-2 with renormalised probabilities, expert size != dense size, and the
    # load-balancing loss on (output_router_logits).
    "tiny-qwen3-moe": dict(_TINY, model_type="qwen3_moe", vocab_size=300, tie_word_embeddings=False,
                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                           decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=True,
                           router_aux_loss_coef=0.01),
    # Mixtral: 4 experts, top-2 (always renormalised), the experts of the dense intermediate size, tied.
    "tiny-mixtral": dict(_TINY, model_type="mixtral", vocab_size=256, tie_word_embeddings=True, sliding_window=None,
                         num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0),
    # ~300k-parameter Qwen2 shape (2 layers, hidden 128, 4/2 heads): the small RL benchmark size
    # in docs/benchmarks.md (tools/bench_rl.py).
    "bench-qwen2-300k": dict(_TINY, model_type="qwen2", vocab_size=128, tie_word_embeddings=True,
                             hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    # ~20M-parameter Qwen2 shape (the RL benchmark size in docs/benchmarks.md).
    "small-qwen2-20m": dict(_TINY, model_type="qwen2", vocab_size=4096, tie_word_embeddings=True,
                            hidden_size=512, intermediate_size=1664, num_hidden_layers=6,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    # ~125M-parameter Llama shape (GPT-2-small-like; 0.5 GB in fp32): the conversion benchmark
    # (tools/bench_convert.py). 12 layers: PP=2 x VPP=2 splits evenly; 4 KV heads: TP up to 4.
    "bench-llama-100m": dict(_TINY, model_type="llama", vocab_size=32000, tie_word_embeddings=False,
                             hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                             num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                             max_position_embeddings=2048),
    # ~1.1B-parameter Llama shape (TinyLlama's): the resharding benchmark's large case.
    "bench-llama-1b": dict(_TINY, model_type="llama", vocab_size=32000, tie_word_embeddings=False,
                           hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                           num_attention_heads=32, num_key_value_heads=4, head_dim=64,
                           max_position_embeddings=2048),
    # ~180M-parameter Qwen3-MoE shape (16 experts, top-4): the resharding benchmark's MoE case.
    "bench-qwen3-moe-200m": dict(_TINY, model_type="qwen3_moe", vocab_size=32000, tie_word_embeddings=False,
                                 hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                 num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                 max_position_embeddings=2048, num_experts=16, num_experts_per_tok=4,
                                 moe_intermediate_size=512, norm_topk_prob=True),
    # Real shapes, for planning, memory estimates and dry runs (never instantiated on CPU).
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      rms_norm_eps=1e-5, max_position_embeddings=8192, hidden_act="silu",
                      tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "llama3-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                       rms_norm_eps=1e-5, max_position_embeddings=8192, hidden_act="silu",
                       tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                       rms_norm_eps=1e-6, max_position_embeddings=32768, hidden_act="silu",
                       tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3-30b-a3b": dict(_QWEN3_MOE, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32),
    "qwen3-235b-a22b": dict(_QWEN3_MOE, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                            num_hidden_layers=94, num_attention_heads=64),
}

TINY_PRESETS = tuple(name for name in PRESETS if name.startswith("tiny-"))


def hf_config_dict(preset: str, **overrides: Any) -> dict[str, Any]:
    """The HF config.json content of a preset, with field overrides."""
    if preset not in PRESETS:
        raise KeyError(f"model preset {preset!r} does not exist; choose one of {sorted(PRESETS)}")
    cfg = copy.deepcopy(PRESETS[preset])
    cfg.update(overrides)
    return cfg


def make_hf_config(preset: str, **overrides: Any):
    """A transformers config object for a preset."""
    from transformers import AutoConfig

    cfg = hf_config_dict(preset, **overrides)
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def save_tiny_hf_model(preset: str, path: str | os.PathLike, seed: int = 0, reward_model: bool = False,
                       **overrides: Any) -> str:
    """Build a randomly initialised HF causal LM for a preset and save it (safetensors + config.json);
    with ``reward_model``, the preset's ``*ForSequenceClassification`` with one label instead.

    Biases and norm weights are randomised too, so a converter that drops or misplaces one is caught.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = make_hf_config(preset, **({"num_labels": 1} if reward_model else {}), **overrides)
    torch.manual_seed(seed)
    auto = AutoModelForSequenceClassification if reward_model else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(str(path))
    return str(path)
