"""Qwen3-MoE family (Qwen3MoeForCausalLM): Qwen3's attention, every MLP an MoE layer (softmax
router, top-k, the top-k probabilities renormalised as ``norm_topk_prob`` says, no shared expert)."""

from model_specs.base import ModelFamily, MoeWeights
from model_specs.qwen3 import _check_qwen3

QWEN3_MOE = ModelFamily(
    name="qwen3_moe", hf_model_type="qwen3_moe", hf_architecture="Qwen3MoeForCausalLM", qk_norm=True,
    extra_fields=frozenset({"moe_intermediate_size", "norm_topk_prob"}), check=_check_qwen3,
    moe=MoeWeights(router="model.layers.{layer}.mlp.gate.weight", expert="model.layers.{layer}.mlp.experts.{expert}",
                   gate="gate_proj.weight", up="up_proj.weight", down="down_proj.weight",
                   ffn_field="moe_intermediate_size"),
    sglang_tied_embeddings=False,
    normalized_topk=lambda hf: bool(hf.get("norm_topk_prob", False)),  # transformers' default
)
