"""tools/gpu_check.py (ci/gpu_check.sh's program) on the CPU with tiny shapes: the same code path the
GPU run takes, minus CUDA. Oracles: HF transformers' logits (its parity phase) and HF's own linear
layers for the FLOP count its MFU uses."""

import json
import subprocess
import sys

import torch

from tools.gpu_check import training_flops_per_token


def test_smoke_run_passes_parity_and_trains(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--smoke", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    parity = [r for r in results if r["phase"] == "parity"]
    training = [r for r in results if r["phase"] == "training"]
    assert [r["spec"] for r in parity] == [r["spec"] for r in training] == ["local"]  # no TE here
    assert parity[0]["max_abs_diff"] <= 1e-4 and parity[0]["positions"] == 64
    assert len(training[0]["losses"]) == 3 and all(loss == loss for loss in training[0]["losses"])
    assert "parity   local" in proc.stdout and "tokens/s" in proc.stdout


def test_flops_count_every_linear_layer_of_the_hf_model():
    """6 x (parameters of every nn.Linear, lm_head included) + 12 * layers * hidden * seq."""
    from transformers import AutoModelForCausalLM

    from model_specs.presets import hf_config_dict, make_hf_config

    for preset in ("tiny-llama", "tiny-qwen3", "bench-qwen2-300k"):
        hf = hf_config_dict(preset)
        model = AutoModelForCausalLM.from_config(make_hf_config(preset))
        linear = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
        linear -= sum(m.bias.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None)
        attention = 12 * hf["num_hidden_layers"] * hf["hidden_size"] * 100
        assert training_flops_per_token(hf, 100) == 6 * linear + attention, preset
