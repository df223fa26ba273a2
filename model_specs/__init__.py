"""Model families and size presets; nothing here knows about processes."""

from model_specs.base import (
    CLASSIFIER_HEAD,
    LAYER_SPECS,
    ModelFamily,
    UnsupportedModelError,
    check_layer_spec,
    classifier_labels,
    layer_spec_of,
    megatron_name,
    padded_vocab_size,
)
from model_specs.llama import LLAMA
from model_specs.mistral import MISTRAL
from model_specs.qwen2 import QWEN2
from model_specs.qwen3 import QWEN3

FAMILIES = {family.hf_model_type: family for family in (LLAMA, QWEN2, QWEN3, MISTRAL)}


def family_for(hf_config: dict) -> ModelFamily:
    """The family of an HF config dict (by model_type), or a clear error listing what is supported."""
    model_type = hf_config.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type={model_type!r} (architectures={hf_config.get('architectures')}) is not "
            f"supported; supported model types: {sorted(FAMILIES)}"
        )
    return FAMILIES[model_type]


__all__ = ["CLASSIFIER_HEAD", "LAYER_SPECS", "classifier_labels", "check_layer_spec", "FAMILIES", "LLAMA", "MISTRAL",
           "QWEN2", "QWEN3", "ModelFamily", "UnsupportedModelError", "family_for", "layer_spec_of", "megatron_name",
           "padded_vocab_size"]
