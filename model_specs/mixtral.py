"""Mixtral family (MixtralForCausalLM): Mistral's attention, every MLP an MoE layer (softmax router,
top-k, the top-k probabilities always renormalised, no shared expert)."""

from model_specs.base import ModelFamily, MoeWeights
from model_specs.mistral import _check_mistral

MIXTRAL = ModelFamily(
    name="mixtral", hf_model_type="mixtral", hf_architecture="MixtralForCausalLM", check=_check_mistral,
    moe=MoeWeights(router="model.layers.{layer}.block_sparse_moe.gate.weight",
                   expert="model.layers.{layer}.block_sparse_moe.experts.{expert}",
                   gate="w1.weight", up="w3.weight", down="w2.weight", ffn_field="intermediate_size"),
    sglang_tied_embeddings=False,
)
