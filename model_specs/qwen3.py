"""Qwen3 (dense) family: Llama-like with RMSNorm on per-head queries and keys, no qkv bias."""

from model_specs.base import ModelFamily, UnsupportedModelError


def _check_qwen3(hf):
    if hf.get("use_sliding_window"):
        raise UnsupportedModelError(
            "use_sliding_window=True is not supported for qwen3; set it to false (released Qwen3 "
            "checkpoints do not use it)"
        )


QWEN3 = ModelFamily(
    name="qwen3", hf_model_type="qwen3", hf_architecture="Qwen3ForCausalLM", qk_norm=True, check=_check_qwen3,
)
