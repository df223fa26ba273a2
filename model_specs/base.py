"""What a decoder-only model family is: HF config <-> Megatron TransformerConfig and the layer spec.

A family is data plus a few pure functions; it knows nothing about processes. Parallel sizes
(TP/PP/VPP/CP/SP) are passed in by the caller (``parallel/``), never decided here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Mapping

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

    ``{layer}`` in the names stands for the global (0-based) decoder layer index; ``{expert}`` for
    the expert index of an MoE layer (in ``hf``: the global expert; in ``megatron``: the expert's
    index among the rank's local experts).
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

    @property
    def per_expert(self) -> bool:
        return "{expert}" in self.megatron


# The Megatron transformer-layer specs whose parameter names megarl maps. "local": megatron's
# get_gpt_layer_local_spec (pure torch; what megarl builds and runs on CPU). "te":
# get_gpt_layer_with_transformer_engine_spec, whose TELayerNormColumnParallelLinear fuses the RMSNorm
# before attention into linear_qkv and the one before the MLP into linear_fc1 (input_layernorm and
# pre_mlp_layernorm are IdentityOp there). Every other parameter has the same name, shape and TP split
# in both; q/k layernorms (Qwen3) and the final norm stay separate norms in TE too.
LAYER_SPECS = ("local", "te")
# local-spec parameter suffix -> TE-spec suffix: the one place the two namings differ. Megatron's
# distributed-checkpoint keys already use the TE spelling for both specs (the local spec declares
# sharded_state_dict_keys_map {'input_layernorm.': 'self_attention.linear_qkv.layer_norm_', ...}).
TE_FUSED_NORM_NAMES = {
    ".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
    ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight",
}


def check_layer_spec(layer_spec: str, field: str = "layer_spec") -> str:
    """``layer_spec`` if megarl maps it, else a ValueError naming ``field``, the value and the choices."""
    if layer_spec not in LAYER_SPECS:
        raise ValueError(f"{field}={layer_spec!r} is not a layer spec megarl maps; use one of {list(LAYER_SPECS)} "
                         "('local': megatron's local spec, 'te': the Transformer Engine spec)")
    return layer_spec


def megatron_name(local_name: str, layer_spec: str) -> str:
    """A Megatron parameter name of the local spec as ``layer_spec`` spells it (``{layer}``
    placeholders and concrete layer indices alike)."""
    if check_layer_spec(layer_spec) == "te":
        for local, te in TE_FUSED_NORM_NAMES.items():
            if local_name.endswith(local):
                return local_name[: -len(local)] + te
    return local_name


def layer_spec_of(parameter_names: Iterable[str]) -> str:
    """Which layer spec a model's parameter names are spelled in: "te" if any is a fused norm
    (``...linear_qkv.layer_norm_weight``), else "local" (a chunk without decoder layers is spelled
    the same in both)."""
    fused = tuple(TE_FUSED_NORM_NAMES.values())
    return "te" if any(name.endswith(fused) for name in parameter_names) else "local"


@dataclasses.dataclass(frozen=True)
class MoeWeights:
    """Where an MoE family's HF checkpoint keeps layer ``{layer}``'s router and experts (every
    decoder layer an MoE layer: no shared expert, no dense layers in between)."""

    router: str  # [num_experts, hidden]
    expert: str  # prefix of expert ``{expert}``'s weights
    gate: str  # the expert's gated-MLP weights under ``expert``, as gate_proj / up_proj / down_proj
    up: str
    down: str
    ffn_field: str  # the HF field with the expert's intermediate size


def num_experts(hf: Mapping[str, Any]) -> int | None:
    """The routed experts per layer of an HF MoE config (transformers reads ``num_experts`` and
    ``num_local_experts`` as one field), None for a dense model."""
    return hf.get("num_experts") or hf.get("num_local_experts")


def gpt_weight_rules(hf: Mapping[str, Any], qkv_bias: bool, qk_norm: bool, layer_spec: str = "local",
                     moe: MoeWeights | None = None) -> list[WeightRule]:
    """Megatron GPT parameters <-> HF Llama-style names (Llama, Qwen2, Qwen3, Mistral; with ``moe``
    the MoE layers of Qwen3-MoE, Mixtral: megatron's router and SequentialMLP experts in place of
    the dense MLP), the Megatron names spelled as ``layer_spec`` (``LAYER_SPECS``) spells them."""
    if moe is not None and check_layer_spec(layer_spec) != "local":
        raise ValueError(f"layer_spec={layer_spec!r} is not mapped for MoE models yet (megatron's TE MoE layer keeps "
                         "pre_mlp_layernorm unfused, under another checkpoint key); use layer_spec='local'")
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
        WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated", "model.norm.weight"),
    ]
    if moe is None:
        rules += [
            WeightRule(f"{layer}.mlp.linear_fc1.weight", (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"),
                       "gate_up", f"{mlp}.gate_up_proj.weight"),
            WeightRule(f"{layer}.mlp.linear_fc2.weight", (f"{mlp}.down_proj.weight",), "row", f"{mlp}.down_proj.weight"),
        ]
    else:
        # Experts split over expert-parallel ranks (whole experts) and, inside one, over expert-TP
        # ranks as a dense MLP over TP. SGLang fuses a layer's experts into stacked tensors, which
        # per-expert rules cannot name: parallel.shards maps those (sglang None here).
        expert = f"{layer}.mlp.experts.local_experts.{{expert}}"
        rules += [
            WeightRule(f"{layer}.mlp.router.weight", (moe.router,), "replicated", moe.router),
            WeightRule(f"{expert}.linear_fc1.weight", (f"{moe.expert}.{moe.gate}", f"{moe.expert}.{moe.up}"), "gate_up"),
            WeightRule(f"{expert}.linear_fc2.weight", (f"{moe.expert}.{moe.down}",), "row"),
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
    return [dataclasses.replace(rule, megatron=megatron_name(rule.megatron, layer_spec)) for rule in rules]


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
    moe: MoeWeights | None = None  # an MoE family's router and expert weights (None: dense)
    # An MoE family's HF norm_topk_prob semantics: renormalise the top-k routing probabilities to
    # sum to 1 (Mixtral always; Qwen3-MoE as its config says), read from the config by this.
    normalized_topk: Callable[[Mapping[str, Any]], bool] = lambda cfg: True
    # Whether SGLang's model class of the family reads tie_word_embeddings (its MoE classes keep
    # a separate lm_head that a tied checkpoint would leave unloaded).
    sglang_tied_embeddings: bool = True

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
        rope_parameters(hf, self.name)  # refuses RoPE variants megarl cannot represent
        refused = sorted(k for k in hf if k in REFUSED_MOE_FIELDS and hf[k] not in MOE_FEATURE_OFF)
        if refused:
            raise UnsupportedModelError(
                f"{refused[0]}={hf[refused[0]]!r} is not supported for {self.name}: megarl does not build "
                f"{REFUSED_MOE_FIELDS[refused[0]]} yet; only models without it convert")
        mapped = COMMON_FIELDS | self.extra_fields | (MOE_FIELDS if self.moe else frozenset())
        unknown = sorted(k for k in hf if k not in IGNORED_HF_FIELDS | mapped)
        if unknown:
            raise UnsupportedModelError(
                f"{self.name} config has fields megarl does not know how to map: {unknown}; "
                f"supported fields: {sorted(mapped)}"
            )
        if self.moe:
            self._check_moe(hf)
        self.check(hf)

    def _check_moe(self, hf: Mapping[str, Any]) -> None:
        """Refuse MoE settings megatron's MoE layer (as megarl builds it) does not compute."""
        experts, topk = num_experts(hf), hf.get("num_experts_per_tok")
        if not (isinstance(experts, int) and experts >= 1 and isinstance(topk, int) and 1 <= topk <= experts):
            raise UnsupportedModelError(f"num_experts={experts!r}, num_experts_per_tok={topk!r} ({self.name}): need "
                                        "1 <= num_experts_per_tok <= num_experts")
        if not isinstance(hf.get(self.moe.ffn_field), int):
            raise UnsupportedModelError(f"{self.moe.ffn_field}={hf.get(self.moe.ffn_field)!r} ({self.name}): the "
                                        "experts' intermediate size is required")
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise UnsupportedModelError(
                f"decoder_sparse_step={hf.get('decoder_sparse_step', 1)!r}, mlp_only_layers="
                f"{hf.get('mlp_only_layers')!r} ({self.name}): only every layer MoE is supported "
                "(decoder_sparse_step=1, mlp_only_layers=[])")
        if hf.get("router_jitter_noise"):
            raise UnsupportedModelError(f"router_jitter_noise={hf['router_jitter_noise']!r} ({self.name}): megatron's "
                                        "router has no multiplicative jitter; only 0 is supported")

    def transformer_config_kwargs(self, hf: Mapping[str, Any]) -> dict:
        """TransformerConfig keyword arguments (model part only) for this HF config."""
        self.validate(hf)
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        return dict(
            **self._moe_config_kwargs(hf),
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

    def _moe_config_kwargs(self, hf: Mapping[str, Any]) -> dict:
        """TransformerConfig MoE fields: megatron's router computing HF's routing exactly (softmax
        over the experts, top-k; HF's renormalised top-k probabilities are the softmax of the top-k
        logits, megatron's moe_router_pre_softmax=False; unnormalised ones its pre-softmax top-k),
        no token dropping (capacity None), SequentialMLP experts (no grouped GEMM: the expert
        weight names ``weight_rules`` maps). The token dispatcher is the run's choice, not the
        family's (``parallel.models.build_model_chunks``). The load-balancing loss is megatron's
        switch loss per layer with HF's coefficient when the config trains with one
        (output_router_logits): not HF's value (HF pools the router statistics of all layers into
        one loss, and megatron's is 1/top-k of HF's for one layer). {} for a dense family."""
        if self.moe is None:
            return {}
        aux = float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0
        return dict(
            num_moe_experts=num_experts(hf),
            moe_router_topk=hf["num_experts_per_tok"],
            moe_ffn_hidden_size=hf[self.moe.ffn_field],
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not self.normalized_topk(hf),
            moe_expert_capacity_factor=None,
            moe_router_load_balancing_type="aux_loss" if aux else "none",
            moe_aux_loss_coeff=aux,
            moe_grouped_gemm=False,
        )

    def weight_rules(self, hf: Mapping[str, Any], layer_spec: str = "local") -> list[WeightRule]:
        """Every Megatron parameter of this family (named as ``layer_spec`` names it) and the HF
        tensors it is made of."""
        self.validate(hf)
        return gpt_weight_rules(hf, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm, layer_spec=layer_spec, moe=self.moe)

    def hf_tensor_names(self, hf: Mapping[str, Any]) -> list[str]:
        """Every tensor an HF checkpoint of this config holds (tied models: no lm_head)."""
        names = []
        for rule in self.weight_rules(hf):
            layers = range(hf["num_hidden_layers"]) if rule.per_layer else [None]
            experts = range(num_experts(hf)) if rule.per_expert else [None]
            for layer in layers:
                for expert in experts:
                    for name in rule.hf:
                        name = name.format(layer=layer, expert=expert)
                        if name not in names:
                            names.append(name)
        return names

    def gpt_model_kwargs(self, hf: Mapping[str, Any]) -> dict:
        """GPTModel keyword arguments (besides config, spec and pipeline placement); RoPE scaling
        as mapped in the comment above ``ROPE_TYPES``."""
        rope = rope_parameters(hf, self.name)
        theta = rope["rope_theta"]
        kwargs = dict(
            vocab_size=hf["vocab_size"],
            max_sequence_length=hf.get("max_position_embeddings", 2048),
            share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
            position_embedding_type="yarn" if rope["rope_type"] == "yarn" else "rope",
            rotary_base=int(theta) if float(theta).is_integer() else float(theta),
        )
        if rope["rope_type"] == "linear":
            kwargs["seq_len_interpolation_factor"] = float(rope["factor"])
        elif rope["rope_type"] == "llama3":
            kwargs.update(rope_scaling=True, rope_scaling_factor=float(rope["factor"]))
        return kwargs

    def yarn_config_attributes(self, hf: Mapping[str, Any]) -> dict:
        """For a yarn model, the ``yarn_*`` attributes its TransformerConfig must carry (GPTModel
        builds the YarnRotaryEmbedding from them, every attention layer takes its mscale from
        them); ``{}`` for any other RoPE. Not dataclass fields: set them on the built config."""
        rope = rope_parameters(hf, self.name)
        if rope["rope_type"] != "yarn":
            return {}
        # HF uses the mscale ratio only when both are non-zero, else get_mscale(factor), which is
        # megatron's ratio at mscale=1, mscale_all_dim=0 (x / 1.0: the same bits).
        both = bool(rope.get("mscale") and rope.get("mscale_all_dim"))
        return dict(
            yarn_rotary_scaling_factor=float(rope["factor"]),
            yarn_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            yarn_beta_fast=float(rope.get("beta_fast") or 32),
            yarn_beta_slow=float(rope.get("beta_slow") or 1),
            yarn_mscale=float(rope["mscale"]) if both else 1.0,
            yarn_mscale_all_dim=float(rope["mscale_all_dim"]) if both else 0.0,
            yarn_correction_range_round_to_int=bool(rope.get("truncate", True)),
        )

    def llama3_scaling_overrides(self, hf: Mapping[str, Any]) -> dict | None:
        """For a llama3-RoPE model whose low/high frequency factors or original context differ from
        megatron-core's hard-coded ones, the keyword arguments of megatron's
        ``RotaryEmbedding._apply_scaling`` that give the checkpoint's frequencies (applied by
        parallel.models after build); None when megatron's own build is already exact."""
        rope = rope_parameters(hf, self.name)
        if rope["rope_type"] != "llama3":
            return None
        values = {key: rope[key] for key in _MEGATRON_LLAMA3}
        if values == _MEGATRON_LLAMA3:
            return None
        return {"factor": rope["factor"], **values}


# ----------------------------------------------------------------------------- RoPE scaling
#
# The HF RoPE variants megarl maps exactly onto megatron-core (and that SGLang applies too, from
# the same config.json, through transformers' config: ``rope_parameters`` in transformers 5,
# aliased as ``rope_scaling``; SGLang's get_rope reads either):
#
# - default: GPTModel ``position_embedding_type='rope'``, ``rotary_base=rope_theta``.
# - linear: GPTModel ``seq_len_interpolation_factor=factor``. megatron multiplies the positions
#   by 1/factor, HF divides inv_freq by factor: the same angles (identical bits when the factor is
#   a power of two, otherwise within one float32 rounding of the angle).
# - llama3: GPTModel ``rope_scaling=True, rope_scaling_factor=factor``. megatron-core's
#   ``RotaryEmbedding._apply_scaling`` (HF's formula) hard-codes low_freq_factor=1,
#   high_freq_factor=4, original_max_position_embeddings=8192 (Llama 3.1/3.2/3.3's values); a
#   checkpoint with other values gets the same ``_apply_scaling`` re-run with its own values right
#   after the model is built (``llama3_scaling_overrides``, applied by parallel.models).
# - yarn: GPTModel ``position_embedding_type='yarn'`` plus the TransformerConfig attributes
#   ``yarn_*`` that GPTModel and the attention read with getattr (``yarn_config_attributes``; they
#   are not dataclass fields, so parallel.models sets them on the built config). megatron's
#   YarnRotaryEmbedding computes HF's inv_freq op for op. Its attention factor (HF's
#   ``attention_factor``, cos/sin times mscale) is not applied by GPTModel's non-MLA path (it drops
#   the mscale the embedding returns) but by every attention layer: ``apply_rotary_pos_emb(...,
#   mscale=_yarn_get_concentration_factor_from_config(config))`` on queries and keys, which is
#   HF's cos*factor, sin*factor on both. That needs ``yarn_rotary_scaling_factor`` on the config,
#   which is why only a yarn model carries these attributes.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Keys each supported rope_type may carry in rope_parameters / rope_scaling besides
# rope_type/type and rope_theta; any other key is refused (it would change the math somewhere).
ROPE_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                       "mscale_all_dim", "attention_factor", "truncate"}),
}
# RoPE types transformers knows that megarl refuses, and why.
REFUSED_ROPE_TYPES = {
    "dynamic": "dynamic NTK changes the frequencies with the current sequence length in HF (and SGLang "
               "instead uses one fixed base extended to max_position_embeddings*factor at every length); "
               "megatron-core's embeddings are static, so neither can be matched exactly",
    "longrope": "megatron-core has no LongRoPE embedding (per-dimension short/long factors)",
}
# megatron-core's _apply_scaling defaults (Llama 3.1's values).
_MEGATRON_LLAMA3 = {"low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 8192}


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    """HF's (and megatron's, SGLang's) ``get_mscale``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _is_number(value: Any) -> bool:
    """A positive JSON number (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def rope_parameters(hf: Mapping[str, Any], name: str = "this model") -> dict:
    """The RoPE an HF config.json describes, read the way transformers reads it, validated.

    Accepts every spelling transformers does: transformers 5's ``rope_parameters`` and
    transformers 4's ``rope_scaling`` (which wins when both are set, as in transformers), the type
    under ``rope_type`` or ``type`` (``rope_type`` wins), ``rope_theta`` inside the dict or at the
    top level (the dict wins; 10000 when absent). Returns a new dict with ``rope_type``,
    ``rope_theta`` and the type's parameters (``original_max_position_embeddings`` defaulting to
    ``max_position_embeddings`` for llama3/yarn, as transformers does). Raises
    UnsupportedModelError naming the field and value for anything megarl cannot represent exactly.
    The config itself is never modified (export writes it back as read).
    """
    scaling, params = hf.get("rope_scaling"), hf.get("rope_parameters")
    field, given = ("rope_scaling", scaling) if scaling else ("rope_parameters", params)
    given = given or {}
    if not isinstance(given, Mapping):
        raise UnsupportedModelError(f"{field}={given!r} is not a dict; {name} needs a dict like "
                                    "{'rope_type': 'default', 'rope_theta': 10000.0}")
    rope = dict(given)
    rope_type = rope.pop("rope_type", None)
    legacy_type = rope.pop("type", None)
    rope_type = rope_type if rope_type is not None else (legacy_type if legacy_type is not None else "default")
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if rope_type not in ROPE_TYPES:
        why = REFUSED_ROPE_TYPES.get(rope_type, "megarl does not know this RoPE variant")
        raise UnsupportedModelError(
            f"{field}.rope_type={rope_type!r} is not supported for {name} ({why}); supported rope types: "
            f"{list(ROPE_TYPES)}")
    theta = rope["rope_theta"]
    if not _is_number(theta):
        raise UnsupportedModelError(f"{field}.rope_theta={theta!r} is not a positive number; set rope_theta")
    unknown = sorted(set(rope) - {"rope_theta"} - ROPE_KEYS[rope_type])
    if unknown:
        raise UnsupportedModelError(
            f"{field} has keys {unknown} that megarl cannot map for rope_type={rope_type!r} ({name}); "
            f"supported keys for {rope_type!r}: {sorted(ROPE_KEYS[rope_type] | {'rope_theta', 'rope_type'})}")
    if rope_type == "default":
        return {"rope_type": rope_type, **rope}
    factor = rope.get("factor")
    if not (_is_number(factor) and factor >= 1):
        raise UnsupportedModelError(
            f"{field}.factor={factor!r} for rope_type={rope_type!r} ({name}): a number >= 1 is required")
    if rope_type in ("llama3", "yarn"):
        rope.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 2048))
        original = rope["original_max_position_embeddings"]
        if not (_is_number(original) and float(original).is_integer()):
            raise UnsupportedModelError(f"{field}.original_max_position_embeddings={original!r} ({name}): a "
                                        "positive integer is required")
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if not _is_number(rope.get(key)):
                raise UnsupportedModelError(f"{field}.{key}={rope.get(key)!r} for rope_type='llama3' ({name}): "
                                            "a positive number is required (Llama 3.1 uses 1.0 and 4.0)")
        if rope["low_freq_factor"] >= rope["high_freq_factor"]:
            raise UnsupportedModelError(
                f"{field}.low_freq_factor={rope['low_freq_factor']!r} >= high_freq_factor="
                f"{rope['high_freq_factor']!r} ({name}): HF divides by their difference and SGLang "
                "special-cases it, so only low_freq_factor < high_freq_factor is supported")
    if rope_type == "yarn":
        _check_yarn(rope, field, name)
    return {"rope_type": rope_type, **rope}


def _check_yarn(rope: dict, field: str, name: str) -> None:
    """Refuse yarn parameters on which HF, megatron-core and SGLang would not compute the same."""
    for key in ("beta_fast", "beta_slow"):
        # HF reads `beta or default` (0 and None mean the default); SGLang takes the value as given.
        if key in rope and not _is_number(rope[key]):
            raise UnsupportedModelError(f"{field}.{key}={rope[key]!r} for rope_type='yarn' ({name}): give a positive "
                                        f"number or leave it out (default {32 if key == 'beta_fast' else 1})")
    if not isinstance(rope.get("truncate", True), bool):
        raise UnsupportedModelError(f"{field}.truncate={rope['truncate']!r} ({name}): true or false")
    factor, mscale, mscale_all_dim = rope["factor"], rope.get("mscale"), rope.get("mscale_all_dim")
    hf_factor = yarn_attention_factor(rope)
    # SGLang's (YaRNScalingRotaryEmbedding): the ratio whenever both are present.
    sglang_factor = (float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
                     if mscale is not None and mscale_all_dim is not None else _yarn_mscale(factor))
    if hf_factor != sglang_factor:
        raise UnsupportedModelError(
            f"{field}.mscale={mscale!r} with mscale_all_dim={mscale_all_dim!r} ({name}): HF reads a zero mscale "
            "as absent and SGLang does not, so rollouts would use another attention factor; use both "
            "non-zero or leave both out")
    explicit = rope.get("attention_factor")
    if explicit is not None and explicit != hf_factor:
        raise UnsupportedModelError(
            f"{field}.attention_factor={explicit!r} ({name}): SGLang ignores attention_factor and megatron-core "
            f"derives it from factor/mscale/mscale_all_dim ({hf_factor!r} here); only that value or no "
            "attention_factor is supported")


def yarn_attention_factor(rope: Mapping[str, Any]) -> float:
    """HF's yarn attention factor (the cos/sin multiplier) of ``rope_parameters``: the ratio of the
    two mscales when both are non-zero, else get_mscale(factor)."""
    factor, mscale, mscale_all_dim = rope["factor"], rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


COMMON_FIELDS = frozenset(
    {
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
        "tie_word_embeddings", "rope_parameters", "rope_theta", "rope_scaling", "mlp_bias",
        "attention_bias",
    }
)


# HF fields an MoE family maps (besides its MoeWeights.ffn_field and family-specific ones).
MOE_FIELDS = frozenset(
    {
        "num_experts", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits",
        "decoder_sparse_step", "mlp_only_layers", "router_jitter_noise",
    }
)
# MoE features of other HF families that megarl does not build yet: set to anything but "off" in a
# config, each is refused by name (field -> what it is).
REFUSED_MOE_FIELDS = {
    "shared_expert_intermediate_size": "shared experts",
    "n_shared_experts": "shared experts",
    "kv_lora_rank": "multi-latent attention (MLA)",
    "q_lora_rank": "multi-latent attention (MLA)",
    "scoring_func": "sigmoid routers",
    "topk_method": "grouped/biased top-k routing",
    "n_group": "grouped top-k routing",
    "routed_scaling_factor": "scaled routing weights",
}
# Values of those fields that mean the feature is off (softmax scoring, plain top-k): not refused
# by name (the field is still one megarl does not map, so validate refuses it as unknown).
MOE_FEATURE_OFF = (None, 0, False, [], {}, "softmax", "greedy")


def dtype_from_name(name: str) -> torch.dtype:
    """'float32' / 'bfloat16' / 'float16' -> torch dtype, with a clear error otherwise."""
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype={name!r} is not supported; use one of {sorted(table)}")
    return table[name]
