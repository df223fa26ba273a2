"""What a decoder-only model family is: HF config <-> Megatron TransformerConfig and the layer spec.

A family is data plus a few pure functions; it knows nothing about processes. Parallel sizes
(TP/PP/VPP/CP/SP) are passed in by the caller (``parallel/``), never decided here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

# HF config fields every supported family may carry and which we either map or know to be
# irrelevant to the math (tokenizer ids, bookkeeping). Anything else that is set to a
# non-default value is refused, so a model we cannot represent never converts silently.
IGNORED_HF_FIELDS = frozenset(
    {
        "architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
        "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
        "max_position_embeddings", "output_hidden_states", "output_attentions", "return_dict",
        "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
        "_name_or_path", "pretraining_tp", "attention_dropout", "max_window_layers", "layer_types",
        "use_sliding_window", "sliding_window",
    }
)


class UnsupportedModelError(ValueError):
    """The HF model (architecture or a config field) is not something megarl can represent."""


CLASSIFIER_HEAD = "score.weight"  # what an HF *ForSequenceClassification checkpoint has instead of lm_head


def classifier_labels(hf: Mapping[str, Any]) -> int | None:
    """Number of labels of an HF sequence-classification config (a reward model: 1), None for a
    causal LM."""
    if not any(a.endswith("ForSequenceClassification") for a in hf.get("architectures") or []):
        return None
    return len(hf.get("id2label") or {0: None})


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """Megatron's vocab padding: round up to a multiple of ``divisible_by * TP``."""
    multiple = divisible_by * tensor_parallel_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


# How the HF tensors of a rule sit inside the Megatron tensor and how it is split over TP ranks.
WEIGHT_KINDS = {
    "replicated": "one HF tensor, whole on every TP rank (norms)",
    "column": "one HF tensor split along dim 0 over TP",
    "row": "one HF tensor split along dim 1 over TP (o_proj, down_proj)",
    "vocab": "one HF tensor, rows zero-padded to the padded vocab, split along dim 0 over TP",
    "qkv": "(q, k, v): per query group g the rows [q heads of g; k_g; v_g], groups split over TP",
    "gate_up": "(gate, up): rank r holds [gate rows of r; up rows of r]",
}


@dataclasses.dataclass(frozen=True)
class WeightRule:
    """One Megatron parameter (name inside a GPTModel chunk) and the HF tensors it is made of.

    ``{layer}`` in the names stands for the global (0-based) decoder layer index.
    """

    megatron: str
    hf: tuple[str, ...]
    kind: str
    sglang: str | None = None  # SGLang's name for the same parameter (None: SGLang has none)

    def __post_init__(self):
        if self.kind not in WEIGHT_KINDS:
            raise ValueError(f"WeightRule.kind={self.kind!r}; expected one of {sorted(WEIGHT_KINDS)}")

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.megatron


def gpt_weight_rules(hf: Mapping[str, Any], qkv_bias: bool, qk_norm: bool) -> list[WeightRule]:
    """Megatron local-spec GPT parameters <-> HF Llama-style names (Llama, Qwen2, Qwen3, Mistral)."""
    layer, attn, mlp = "decoder.layers.{layer}", "model.layers.{layer}.self_attn", "model.layers.{layer}.mlp"
    rules = [
        WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab",
                   "model.embed_tokens.weight"),
        WeightRule(f"{layer}.input_layernorm.weight", ("model.layers.{layer}.input_layernorm.weight",), "replicated",
                   "model.layers.{layer}.input_layernorm.weight"),
        WeightRule(f"{layer}.self_attention.linear_qkv.weight",
                   (f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"), "qkv",
                   f"{attn}.qkv_proj.weight"),
        WeightRule(f"{layer}.self_attention.linear_proj.weight", (f"{attn}.o_proj.weight",), "row",
                   f"{attn}.o_proj.weight"),
        WeightRule(f"{layer}.pre_mlp_layernorm.weight",
                   ("model.layers.{layer}.post_attention_layernorm.weight",), "replicated",
                   "model.layers.{layer}.post_attention_layernorm.weight"),
        WeightRule(f"{layer}.mlp.linear_fc1.weight", (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"), "gate_up",
                   f"{mlp}.gate_up_proj.weight"),
        WeightRule(f"{layer}.mlp.linear_fc2.weight", (f"{mlp}.down_proj.weight",), "row", f"{mlp}.down_proj.weight"),
        WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated", "model.norm.weight"),
    ]
    if qkv_bias:
        rules.append(WeightRule(f"{layer}.self_attention.linear_qkv.bias",
                                (f"{attn}.q_proj.bias", f"{attn}.k_proj.bias", f"{attn}.v_proj.bias"), "qkv",
                                f"{attn}.qkv_proj.bias"))
    if qk_norm:
        rules.append(WeightRule(f"{layer}.self_attention.q_layernorm.weight", (f"{attn}.q_norm.weight",), "replicated",
                                f"{attn}.q_norm.weight"))
        rules.append(WeightRule(f"{layer}.self_attention.k_layernorm.weight", (f"{attn}.k_norm.weight",), "replicated",
                                f"{attn}.k_norm.weight"))
    # Tied: the output layer (present as a parameter only on the last stage when PP > 1) is a
    # copy of the embedding, and SGLang reuses its embedding; untied: it is lm_head.
    tied = bool(hf.get("tie_word_embeddings"))
    lm_head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    rules.append(WeightRule("output_layer.weight", (lm_head,), "vocab", None if tied else "lm_head.weight"))
    return rules


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One model family (Llama, Qwen2, ...): how its HF config maps onto megatron-core."""

    name: str
    hf_model_type: str
    hf_architecture: str
    qkv_bias: bool = False  # bias on the fused QKV projection only (Qwen2), never on o_proj
    qk_norm: bool = False  # RMSNorm on per-head queries and keys (Qwen3)
    # Which HF fields this family maps, beyond the common ones handled in ``transformer_config``.
    extra_fields: frozenset = frozenset()
    # Extra validation of an HF config (raise UnsupportedModelError with the field and the fix).
    check: Callable[[Mapping[str, Any]], None] = lambda cfg: None

    def validate(self, hf: Mapping[str, Any]) -> None:
        """Refuse configs this family cannot represent exactly."""
        if hf.get("model_type") != self.hf_model_type:
            raise UnsupportedModelError(
                f"model_type={hf.get('model_type')!r} is not {self.name} (expected "
                f"{self.hf_model_type!r}); pick the family that matches config.json"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(
                f"hidden_act={hf['hidden_act']!r} is not supported for {self.name}; only 'silu' is"
            )
        if hf.get("attention_bias", False) and not self.qkv_bias:
            raise UnsupportedModelError(
                f"attention_bias=True is not supported for {self.name} (it also biases o_proj); "
                "only attention_bias=False is"
            )
        if hf.get("mlp_bias", False):
            raise UnsupportedModelError(f"mlp_bias=True is not supported for {self.name}; only False is")
        rope = hf.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
            raise UnsupportedModelError(
                f"rope_parameters={rope!r} / rope_scaling={hf.get('rope_scaling')!r}: only the default "
                f"RoPE (no scaling) is supported for {self.name} so far"
            )
        known = IGNORED_HF_FIELDS | COMMON_FIELDS | self.extra_fields
        unknown = sorted(k for k in hf if k not in known)
        if unknown:
            raise UnsupportedModelError(
                f"{self.name} config has fields megarl does not know how to map: {unknown}; "
                f"supported fields: {sorted(COMMON_FIELDS | self.extra_fields)}"
            )
        self.check(hf)

    def transformer_config_kwargs(self, hf: Mapping[str, Any]) -> dict:
        """TransformerConfig keyword arguments (model part only) for this HF config."""
        self.validate(hf)
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        return dict(
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            ffn_hidden_size=hf["intermediate_size"],
            num_attention_heads=num_heads,
            num_query_groups=hf.get("num_key_value_heads") or num_heads,
            kv_channels=head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_norm,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            init_method_std=hf.get("initializer_range", 0.02),
            # Fusions that need CUDA kernels; the unfused paths are exact.
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
        )

    def weight_rules(self, hf: Mapping[str, Any]) -> list[WeightRule]:
        """Every Megatron parameter of this family and the HF tensors it is made of."""
        self.validate(hf)
        return gpt_weight_rules(hf, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm)

    def hf_tensor_names(self, hf: Mapping[str, Any]) -> list[str]:
        """Every tensor an HF checkpoint of this config holds (tied models: no lm_head)."""
        names = []
        for rule in self.weight_rules(hf):
            layers = range(hf["num_hidden_layers"]) if rule.per_layer else [None]
            for layer in layers:
                for name in rule.hf:
                    name = name.format(layer=layer)
                    if name not in names:
                        names.append(name)
        return names

    def gpt_model_kwargs(self, hf: Mapping[str, Any]) -> dict:
        """GPTModel keyword arguments (besides config, spec and pipeline placement)."""
        rope = hf.get("rope_parameters") or {}
        return dict(
            vocab_size=hf["vocab_size"],
            max_sequence_length=hf.get("max_position_embeddings", 2048),
            share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
            position_embedding_type="rope",
            rotary_base=int(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        )


COMMON_FIELDS = frozenset(
    {
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
        "tie_word_embeddings", "rope_parameters", "rope_theta", "rope_scaling", "mlp_bias",
        "attention_bias",
    }
)


def dtype_from_name(name: str) -> torch.dtype:
    """'float32' / 'bfloat16' / 'float16' -> torch dtype, with a clear error otherwise."""
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype={name!r} is not supported; use one of {sorted(table)}")
    return table[name]
