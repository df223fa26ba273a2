"""tools/gpu_check.py (ci/gpu_check.sh's program) on the CPU with tiny shapes: the same code path the
GPU run takes, minus CUDA. Oracles: HF transformers' logits (its parity phase) and HF's own linear
layers for the FLOP count its MFU uses; the results file for the failure handling (a phase forced
to fail through ``--fail-phase``, the program's own switch for this)."""

import json
import subprocess
import sys

import torch

from tools.gpu_check import training_flops_per_token

WORKER = ("setup", "forward", "update", "checkpoint", "export")


def _smoke(tmp_path, *extra):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--smoke", "--json", str(out), *extra],
                          capture_output=True, text=True, timeout=600)
    return proc, json.loads(out.read_text())


def test_smoke_run_passes_parity_and_trains(tmp_path):
    proc, results = _smoke(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # environment report first, the local spec's training before its parity, the RL worker's
    # phases, TE and the attention phase skipped (no TE, no CUDA here)
    assert [(r["phase"], r.get("spec")) for r in results] == [
        ("environment", None), ("training", "local"), ("parity", "local"), *[(f"worker {name}", None) for name in WORKER],
        ("te", None), ("attention", None)]
    env, training, parity, *worker, te, attention = results
    assert all(r["ok"] and "skipped" not in r for r in worker)
    forward, update, checkpoint, export = worker[1:]
    assert forward["output_devices"] == ["cpu"] and forward["max_abs_diff"] <= 1e-4  # against HF transformers
    assert update["logp_moved"] > 0 and checkpoint["max_abs_diff"] == 0.0 and export["max_abs_diff"] <= 1e-4
    assert env["torch"] == torch.__version__ and env["te"]["usable"] is False and "ulimit_n" in env
    assert te["skipped"] and te["ok"]
    assert attention["ok"] and "no CUDA device" in attention["skipped"]
    assert parity["max_abs_diff"] <= 1e-4 and parity["positions"] == 64
    assert len(training["losses"]) == 3 and all(loss == loss for loss in training["losses"])
    assert "parity   local" in proc.stdout and "tokens/s" in proc.stdout


def test_a_failing_phase_is_recorded_and_the_later_phases_still_run(tmp_path):
    """--fail-phase makes the local training raise (no mock: the real phase runner): the run goes
    on to parity and the TE decision, exits 1, and the file holds every phase with the error."""
    proc, results = _smoke(tmp_path, "--fail-phase", "training:local")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [(r["phase"], r.get("spec"), r["ok"]) for r in results] == [
        ("environment", None, True), ("training", "local", False), ("parity", "local", True),
        *[(f"worker {name}", None, True) for name in WORKER], ("te", None, True), ("attention", None, True)]
    assert "forced failure of training:local" in results[1]["error"]
    assert "training local FAILED" in proc.stdout


def test_a_rank_that_dies_loses_none_of_the_phases_it_finished(tmp_path):
    """The rank exits without a word in the middle of its group (as a kill or a segfault would):
    the training it finished before is in the file, and the dead rank is recorded as a failure."""
    proc, results = _smoke(tmp_path, "--fail-phase", "parity:local:exit")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [(r["phase"], r["ok"]) for r in results] == [
        ("environment", True), ("training", True), ("ranks", False), *[(f"worker {name}", True) for name in WORKER],
        ("te", True), ("attention", True)]
    assert results[1]["spec"] == "local" and len(results[1]["losses"]) == 3
    assert results[2]["group"] == "local" and "died without a result" in results[2]["error"]


def test_a_failed_worker_phase_skips_the_worker_phases_after_it(tmp_path):
    proc, results = _smoke(tmp_path, "--fail-phase", "worker update")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    worker = {r["phase"]: r for r in results if r["phase"].startswith("worker ")}
    assert [r["ok"] for r in worker.values()] == [True, True, False, True, True]
    assert worker["worker checkpoint"]["skipped"] == worker["worker export"]["skipped"] == "worker update failed"


def test_device_peaks_tell_h100_variants_apart():
    from tools.gpu_check import device_peak_tflops

    assert device_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert device_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert device_peak_tflops("NVIDIA H100 NVL") == 835.0
    assert device_peak_tflops("NVIDIA H200") == 989.0
    assert device_peak_tflops("cpu") is None


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


def test_attention_phase_measures_branch_attention_and_the_plan():
    """The attention phase's code on the CPU at a tiny GQA shape (4 query / 2 KV heads of 16): it
    runs branch attention forward and backward, agrees with float64, and the plan's count for
    the GPU shape is the closed form: over the 8 padded rows' 8 x 3072 tokens, per token q/k/v/out
    at 8 / 1 heads of 128 (2 x 1024 + 2 x 128 elements), the bias over 3072 keys, K/V at 8 heads
    instead of 1 (2 x 1024 - 2 x 128) and SDPA's own output (1024), bf16."""
    from tools.gpu_check_attention import SHAPE, attention_check, planned_bytes

    r = attention_check(torch.device("cpu"), "tiny-llama", tp=1, prompt=8, branches=3, branch_len=5,
                        dtype=torch.float32, reps=1)
    assert r["ok"] and r["small_max_abs_diff"] < 1e-5 and r["forward_backward_ms"] > 0
    assert (r["shape"]["heads"], r["shape"]["kv_heads"], r["shape"]["head_dim"]) == (4, 2, 16)
    assert "FLASH_ATTENTION" in r["fused_kernels"]["masked_expanded"]  # the CPU's fused kernel takes the call
    assert "kept_bytes" not in r  # no allocator counters on the CPU
    tokens = 8 * 3072
    assert SHAPE == dict(preset="llama3-70b", tp=8, prompt=1024, branches=8, branch_len=2048)
    assert planned_bytes(**SHAPE, dtype_size=2) == tokens * 2 * (
        2 * 1024 + 2 * 128 + 3072 + 2 * 1024 - 2 * 128 + 1024)
