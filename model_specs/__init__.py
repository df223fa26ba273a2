"""Model families and size presets; nothing here knows about processes."""

from model_specs.base import (
    CLASSIFIER_HEAD,
    LAYER_SPECS,
    ModelFamily,
    MoeWeights,
    UnsupportedModelError,
    check_layer_spec,
    classifier_labels,
    layer_spec_of,
    megatron_name,
    num_experts,
    padded_vocab_size,
)
from model_specs.llama import LLAMA
from model_specs.mistral import MISTRAL
from model_specs.mixtral import MIXTRAL
from model_specs.qwen2 import QWEN2
from model_specs.qwen3 import QWEN3
from model_specs.qwen3_moe import QWEN3_MOE

FAMILIES = {family.hf_model_type: family for family in (LLAMA, QWEN2, QWEN3, MISTRAL, QWEN3_MOE, MIXTRAL)}
# MoE model types megarl does not build yet, and the feature that is missing.
UNBUILT_MOE_TYPES = {
    "qwen2_moe": "shared experts (shared_expert_intermediate_size)",
    "deepseek_v2": "multi-latent attention (kv_lora_rank) and shared experts (n_shared_experts)",
    "deepseek_v3": "multi-latent attention (kv_lora_rank), shared experts (n_shared_experts) and a sigmoid router "
                   "with bias (scoring_func='sigmoid', e_score_correction_bias)",
}


def family_for(hf_config: dict) -> ModelFamily:
    """The family of an HF config dict (by model_type), or a clear error listing what is supported."""
    model_type = hf_config.get("model_type")
    if model_type in UNBUILT_MOE_TYPES:
        raise UnsupportedModelError(f"model_type={model_type!r} needs {UNBUILT_MOE_TYPES[model_type]}, which megarl "
                                    f"does not build yet; supported model types: {sorted(FAMILIES)}")
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type={model_type!r} (architectures={hf_config.get('architectures')}) is not "
            f"supported; supported model types: {sorted(FAMILIES)}"
        )
    return FAMILIES[model_type]


__all__ = ["CLASSIFIER_HEAD", "LAYER_SPECS", "classifier_labels", "check_layer_spec", "FAMILIES", "LLAMA", "MISTRAL",
           "MIXTRAL", "QWEN2", "QWEN3", "QWEN3_MOE", "ModelFamily", "MoeWeights", "UnsupportedModelError", "family_for",
           "layer_spec_of", "megatron_name", "num_experts", "padded_vocab_size"]
