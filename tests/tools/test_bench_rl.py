"""``tools/bench_rl.py``'s GEMM floor counts the step's matrix products from the model config:
their FLOPs must equal the closed form over the weights of the model transformers builds from the
same config (its ``nn.Linear`` layers and output layer)."""

import pytest
import torch
import transformers

from model_specs.presets import hf_config_dict, make_hf_config
from tools.bench_rl import COMPLETIONS_PER_STEP, PROMPTS_PER_STEP, step_gemms


def _flops(gemms) -> int:
    return sum(count * 2 * m * k * n for count, m, k, n in gemms)


@pytest.mark.parametrize("preset", ["bench-qwen2-300k", "tiny-llama"])
def test_step_gemms_count_the_flops_of_the_hf_model_built_from_the_config(preset):
    hf = hf_config_dict(preset)
    model = transformers.AutoModelForCausalLM.from_config(make_hf_config(preset))
    layers = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    head = model.lm_head.weight.numel()
    prompt_tokens, length, rows = 83, 16, COMPLETIONS_PER_STEP
    gemms = step_gemms(hf, prompt_tokens, length)
    assert _flops(gemms["update"]) == 6 * ((prompt_tokens + rows * length) * layers + rows * length * head)
    assert _flops(gemms["generate"]) == 2 * (prompt_tokens * layers + PROMPTS_PER_STEP * head
                                             + (length - 1) * rows * (layers + head))
