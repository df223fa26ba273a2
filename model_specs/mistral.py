"""Mistral family (v0.2 and later: no sliding window): Llama's layout under another name."""

from model_specs.base import ModelFamily, UnsupportedModelError

# What HF transformers' MistralConfig takes for a config.json without max_position_embeddings.
HF_DEFAULT_MAX_POSITIONS = 4096 * 32


def _check_mistral(hf):
    window = hf.get("sliding_window")
    if window is not None and window < hf.get("max_position_embeddings", HF_DEFAULT_MAX_POSITIONS):
        raise UnsupportedModelError(
            f"sliding_window={window} is not supported for mistral (megarl's attention is full causal); "
            "Mistral v0.2 and later checkpoints have sliding_window: null"
        )


MISTRAL = ModelFamily(name="mistral", hf_model_type="mistral", hf_architecture="MistralForCausalLM",
                      check=_check_mistral)
