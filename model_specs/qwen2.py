"""Qwen2 / Qwen2.5 family: like Llama plus a bias on the fused QKV projection."""

from model_specs.base import ModelFamily, UnsupportedModelError


def _check_qwen2(hf):
    if hf.get("use_sliding_window"):
        raise UnsupportedModelError(
            "use_sliding_window=True is not supported for qwen2; set it to false (the released "
            "Qwen2/2.5 checkpoints do not use it)"
        )


QWEN2 = ModelFamily(
    name="qwen2", hf_model_type="qwen2", hf_architecture="Qwen2ForCausalLM",
    qkv_bias=True,
    check=_check_qwen2,
)
