"""GPU acceptance check: the project's own Megatron path on one CUDA GPU, in a few minutes.

    bash ci/gpu_check.sh                 # on the GPU machine: installs carried wheels, runs this
    python -m tools.gpu_check --smoke    # the same code on CPU with tiny shapes (the test suite runs it)

Two phases, for every layer spec this machine can build (``local``: megatron's local spec with
the project's SDPA core attention; ``te``: Transformer Engine's spec, when TE imports):

1. parity: a tiny Llama's logits over 256 positions, Megatron on the device in fp32 (TF32 off)
   against HF transformers on the CPU in fp32; fails above ``PARITY_ATOL``.
2. training: a ~1.1B Llama shape (``bench-llama-1b``) at bf16 with fp32 main grads and the
   distributed optimizer, a few optimizer steps through megatron's schedule
   (``megarl.training.train_step``); prints tokens/s, model TFLOP/s and MFU against H200's
   dense bf16 peak and against a bf16 matmul timed in the same run (the physical bound).

Exit status 0 when every phase ran and parity held, 1 otherwise. A benchmark and check, not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import types

import torch

# fp32 GPU kernels (SDPA's memory-efficient kernel, cuBLAS without TF32) sum in other orders than
# the CPU's: observed differences of fp32 logits are ~1e-6 relative; 1e-4 absolute on logits of
# magnitude ~1 leaves 100x margin and still catches a wrong mask, RoPE or weight (>= 1e-2).
PARITY_ATOL = 1e-4
H200_DENSE_BF16_TFLOPS = 989.0  # NVIDIA's datasheet figure (dense, no sparsity)
MATMUL_SIDE = 8192


def layer_specs() -> list[str]:
    """The layer specs this machine can build: local always, TE where it imports."""
    from parallel.models import default_layer_spec

    return ["local"] + (["te"] if default_layer_spec() == "te" else [])


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def parity(spec: str, preset: str, positions: int) -> dict:
    """Max |logit difference| of Megatron (this device, fp32) vs HF transformers (CPU, fp32)."""
    from megatron.core import parallel_state

    from model_specs.presets import save_tiny_hf_model
    from parallel.checkpoint.convert import load_hf_into_chunks
    from parallel.checkpoint.hf_io import HFCheckpoint
    from parallel.forward import megatron_logits
    from parallel.layout import MegatronLayout
    from parallel.models import build_model_chunks
    from parallel.process_groups import initialize_megatron

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    layout = MegatronLayout()
    initialize_megatron(layout)
    with tempfile.TemporaryDirectory() as hf_dir:
        save_tiny_hf_model(preset, hf_dir, seed=1, max_position_embeddings=max(positions, 256))
        ckpt = HFCheckpoint(hf_dir)
        tokens = torch.randint(0, ckpt.config["vocab_size"], (1, positions), generator=torch.Generator().manual_seed(0))
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            expected = hf_model(tokens).logits
        chunks = build_model_chunks(ckpt.config, layout, layer_spec=spec)
        load_hf_into_chunks(chunks, ckpt, layout)
        for chunk in chunks:
            chunk.eval()
        logits = megatron_logits(chunks, tokens.to(_device()))[..., : ckpt.config["vocab_size"]].cpu()
    parallel_state.destroy_model_parallel()
    diff = float((logits - expected).abs().max())
    return {"phase": "parity", "spec": spec, "positions": positions, "max_abs_diff": diff, "ok": diff <= PARITY_ATOL}


def matmul_tflops(side: int, repeats: int = 10) -> float:
    """bf16 TFLOP/s of a side^3 matmul on this device (mean of ``repeats`` after warm-up)."""
    a = torch.randn(side, side, dtype=torch.bfloat16, device=_device())
    b = torch.randn(side, side, dtype=torch.bfloat16, device=_device())
    for _ in range(3):
        a @ b
    _sync()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync()
    return 2 * side**3 * repeats / (time.perf_counter() - start) / 1e12


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def training_flops_per_token(hf: dict, seq: int) -> float:
    """Model FLOPs per trained token: 6 x active matmul weights (forward + backward; the output
    layer is a matmul, the embedding a lookup: ``model_specs.arithmetic``) plus attention scores
    and values (12 * layers * hidden * seq, the usual non-causal count as in the PaLM MFU)."""
    from model_specs.arithmetic import parameter_counts

    return 6 * parameter_counts(hf).active_matmul + 12 * hf["num_hidden_layers"] * hf["hidden_size"] * seq


def training(spec: str, preset: str, seq: int, micro_batch: int, micro_batches: int, steps: int, warmup: int) -> dict:
    """Tokens/s of bf16 training steps (fp32 main grads, distributed optimizer) through megatron's schedule."""
    from megatron.core import parallel_state

    from megarl.training import build_optimizer, train_step, wrap_ddp
    from model_specs.presets import hf_config_dict
    from parallel.layout import MegatronLayout
    from parallel.models import build_model_chunks
    from parallel.process_groups import initialize_megatron

    layout = MegatronLayout(use_distributed_optimizer=True)
    initialize_megatron(layout)
    hf = hf_config_dict(preset, max_position_embeddings=max(seq, 2048))
    start = time.perf_counter()
    chunks = wrap_ddp(build_model_chunks(hf, layout, params_dtype=torch.bfloat16, layer_spec=spec), layout)
    # megarl.training.AdamSettings as a plain object: megarl.config's OptimSettings needs pydantic,
    # which the GPU machine's image need not have (ci/gpu_wheels.sh carries megatron-core alone).
    adam = types.SimpleNamespace(lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, clip_grad=1.0)
    optimizer = build_optimizer(chunks, adam, layout)
    build_s = time.perf_counter() - start
    generator = torch.Generator().manual_seed(0)

    def batch():
        tokens = torch.randint(0, hf["vocab_size"], (micro_batch, seq + 1), generator=generator).to(_device())
        return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones_like(tokens[:, 1:])}

    losses, times = [], []
    for step in range(warmup + steps):
        micro = [batch() for _ in range(micro_batches)]
        _sync()
        start = time.perf_counter()
        result = train_step(chunks, optimizer, micro, seq)
        _sync()
        if step >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(result["loss"])
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    parallel_state.destroy_model_parallel()
    tokens_per_step = micro_batch * micro_batches * seq
    step_s = sum(times) / len(times)
    model_tflops = training_flops_per_token(hf, seq) * tokens_per_step / step_s / 1e12
    return {"phase": "training", "spec": spec, "preset": preset, "seq": seq, "tokens_per_step": tokens_per_step,
            "build_s": round(build_s, 1), "step_s": round(step_s, 3), "tokens_per_s": round(tokens_per_step / step_s),
            "model_tflops": round(model_tflops, 1), "losses": [round(x, 4) for x in losses],
            "peak_memory_gib": round(peak_gib, 1), "ok": all(x == x for x in losses)}


def check_on_rank(smoke: bool) -> list[dict]:
    """Every phase for every implementation, on this (single) rank."""
    results = []
    for spec in layer_specs():
        results.append(parity(spec, "tiny-llama", 64 if smoke else 256))
        if smoke:
            results.append(training(spec, "tiny-llama", seq=32, micro_batch=2, micro_batches=2, steps=2, warmup=1))
        else:
            results.append(training(spec, "bench-llama-1b", seq=2048, micro_batch=4, micro_batches=4, steps=5, warmup=2))
    if not smoke:
        results.append({"phase": "matmul", "side": MATMUL_SIDE, "tflops": round(matmul_tflops(MATMUL_SIDE), 1), "ok": True})
    return results


def report(results: list[dict]) -> str:
    """Human-readable lines: parity per implementation, throughput with MFU against both bounds."""
    matmul = next((r["tflops"] for r in results if r["phase"] == "matmul"), None)
    lines = []
    for r in results:
        if r["phase"] == "parity":
            lines.append(f"parity   {r['spec']:5s} {r['positions']} positions: max |logit diff| {r['max_abs_diff']:.2e} "
                         f"(limit {PARITY_ATOL:.0e}) {'ok' if r['ok'] else 'FAILED'}")
        elif r["phase"] == "training":
            mfu = f"MFU {r['model_tflops'] / H200_DENSE_BF16_TFLOPS:.1%} of {H200_DENSE_BF16_TFLOPS:.0f} TFLOP/s"
            if matmul:
                mfu += f", {r['model_tflops'] / matmul:.1%} of the measured matmul"
            lines.append(f"training {r['spec']:5s} {r['preset']} seq {r['seq']}: {r['tokens_per_s']} tokens/s, "
                         f"{r['step_s']} s/step, {r['model_tflops']} TFLOP/s ({mfu}), peak {r['peak_memory_gib']} GiB, "
                         f"build {r['build_s']} s, losses {r['losses']}")
        else:
            lines.append(f"matmul   bf16 {r['side']}^3: {r['tflops']} TFLOP/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU too")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; run on a GPU machine, or pass --smoke for the CPU path",
              file=sys.stderr)
        return 1
    from parallel.spawn import run_on_ranks

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"gpu_check: torch {torch.__version__} on {device}; layer specs {layer_specs()}", flush=True)
    (results,) = run_on_ranks(check_on_rank, 1, args.smoke, timeout_s=600)
    print(report(results), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
