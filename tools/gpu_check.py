"""GPU acceptance check: the project's own Megatron path on one CUDA GPU, in a few minutes.

    bash ci/gpu_check.sh [--json out.json]   # on the GPU machine: installs carried wheels, runs this
    python -m tools.gpu_check --smoke        # the same code on CPU with tiny shapes (the test suite runs it)

Phases, in this order, each in its own try block (a phase that raises is recorded as failed with
its error and the run goes on), each result printed and written to the JSON file as soon as it
exists (the whole list, atomically: a temporary name, then a rename), so a failure, a rank that
dies or the shell's timeout loses none of the phases already finished:

1. environment: torch/CUDA/NCCL versions, the device and its own dense bf16 peak where known
   (H100 SXM, PCIe, NVL; H200), the NVIDIA driver (``nvidia-smi``), megatron-core,
   ``transformer_engine.pytorch`` and megatron's ``HAVE_TE``, what parity needs (transformers,
   safetensors, tokenizers, huggingface_hub), SGLang's pieces (sglang, sgl_kernel, flashinfer,
   torch_memory_saver: present or not), ``ulimit -l``/``-n``, the size of /dev/shm and the GPUs'
   health (uncorrectable ECC errors, pending page retirement or row remapping, reset required:
   the preflight's readers, ``parallel.preflight_host``).
2. local spec (megatron's local spec with the project's SDPA core attention), on one rank:
   a bf16 matmul (the physical bound, GPU only); bf16 training of a ~1.1B Llama shape
   (``bench-llama-1b``) with fp32 main grads and the distributed optimizer, a few optimizer steps
   through megatron's schedule (``megarl.training.train_step``): tokens/s, model TFLOP/s, MFU
   against the device's peak and against the matmul, peak GiB; then parity: a tiny Llama's logits
   over 256 positions, Megatron on the device in fp32 (TF32 off) against HF transformers on the
   CPU in fp32, failing above ``PARITY_ATOL``.
3. the RL worker (``tools.gpu_check_worker``), on a fresh rank: ``MegatronWorker`` setup, the
   reference's log-probs against HF transformers', PPO updates, a distributed-checkpoint round trip
   and the HF export, each a phase of its own.
4. TE spec, where ``transformer_engine.pytorch`` imports and megatron's ``HAVE_TE`` holds: parity
   then training, on a fresh rank with ``NVIDIA_TF32_OVERRIDE=0`` in its environment (TE's
   cuBLASLt GEMMs use TF32 for fp32 inputs whatever torch's flag says: ~1e-3 logit error).
5. attention, in this process: shared-prompt rows' attention at a Llama-70B GQA shape on the
   memory-efficient kernel, its time and memory against ``parallel.memory``'s count
   (``tools.gpu_check_attention``; skipped without CUDA).

Training runs before parity because parity needs transformers, which a bare GPU image may lack.
Exit status 0 when every phase ran and held (a skipped phase holds), 1 otherwise. A benchmark and
check, not a test. ``--fail-phase`` makes one phase fail on purpose (the test suite's check that a
failure loses nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import types
from importlib import metadata, util

import torch

from parallel.preflight_host import gpu_health_problems, host_facts
from tools.gpu_check_attention import attention_phase
from tools.gpu_check_attention import report_line as attention_report_line

# fp32 GPU kernels (SDPA's memory-efficient kernel, cuBLAS without TF32) sum in other orders than
# the CPU's: observed differences of fp32 logits are ~1e-6 relative; 1e-4 absolute on logits of
# magnitude ~1 leaves 100x margin and still catches a wrong mask, RoPE or weight (>= 1e-2).
PARITY_ATOL = 1e-4
MATMUL_SIDE = 8192
# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s, matched against
# torch.cuda.get_device_name() in this order (the first substring found wins).
DENSE_BF16_TFLOPS = (
    ("H100 NVL", 835.0),
    ("H100 PCIE", 756.0),
    ("H100", 989.0),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200 NVL", 835.0),
    ("H200", 989.0),  # SXM
    ("GH200", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
)
RANK_TIMEOUT_S = 240.0  # per group of phases (local, worker, TE); ci/gpu_check.sh's timeout exceeds all three


def device_peak_tflops(name: str) -> float | None:
    """The device's own dense bf16 peak from its name, None where not listed."""
    upper = name.upper()
    return next((peak for key, peak in DENSE_BF16_TFLOPS if key in upper), None)


class Results:
    """The run's results as a JSON list in ``path``, rewritten whole and atomically after every
    phase (``parallel.checkpoint.atomic.atomic_file``), so a reader, a failure or a kill always
    finds every phase finished so far."""

    def __init__(self, path: str):
        self.path = path

    def load(self) -> list[dict]:
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return []

    def add(self, result: dict) -> None:
        from parallel.checkpoint.atomic import atomic_file

        results = self.load() + [result]
        with atomic_file(self.path) as partial:
            partial.write_text(json.dumps(results, indent=2))
        print(report_line(result, results), flush=True)


def _forced(fail_phase: str | None, phase: str, spec: str | None) -> str | None:
    """The failure mode ("raise", "exit" or "hang") when ``--fail-phase`` names this phase, else None."""
    if not fail_phase:
        return None
    parts = fail_phase.split(":")
    name, want_spec = parts[0], parts[1] if len(parts) > 1 and parts[1] else None
    mode = parts[2] if len(parts) > 2 else "raise"
    if name == phase and want_spec in (None, spec):
        return mode
    return None


def run_phase(results: Results, phase: str, spec: str | None, fn, fail_phase: str | None = None) -> dict:
    """``fn()``'s result dict, or a failed record with the error; recorded either way."""
    start = time.perf_counter()
    try:
        mode = _forced(fail_phase, phase, spec)
        if mode == "exit":  # a rank that dies without a word (a kill, a segfault)
            os._exit(3)
        if mode == "hang":  # a phase that never ends (the rank's, then the shell's timeout)
            time.sleep(10**6)
        if mode:
            raise RuntimeError(f"forced failure of {phase}{':' + spec if spec else ''} (--fail-phase)")
        result = fn()
    except Exception as exc:  # noqa: BLE001 - every phase's failure is a result, not the end of the run
        result = {"phase": phase, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-4000:]}
        if spec is not None:
            result["spec"] = spec
        _cleanup()
    result["seconds"] = round(time.perf_counter() - start, 1)
    results.add(result)
    return result


def _cleanup() -> None:
    """Leave no megatron state or cached GPU memory behind a failed phase."""
    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except Exception:  # noqa: BLE001
        pass
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _version(dist_name: str) -> str | None:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def _present(module: str, dist_name: str | None = None) -> str | None:
    """The installed version of ``module`` (found without importing it), "present" where it has no
    distribution metadata, None where it is absent."""
    try:
        if util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):
        return None
    return _version(dist_name or module) or "present"


def te_status() -> dict:
    """Whether the TE spec can run: ``transformer_engine.pytorch`` imports (not the bare package,
    which imports where its torch extension is ABI-broken) and megatron's ``HAVE_TE`` holds."""
    status: dict = {"transformer_engine": _present("transformer_engine")}
    try:
        import transformer_engine.pytorch  # noqa: F401

        status["te_pytorch"] = True
    except Exception as exc:  # noqa: BLE001 - ImportError, or an OSError/RuntimeError of a broken build
        status["te_pytorch"] = False
        status["te_pytorch_error"] = f"{type(exc).__name__}: {exc}"[:500]
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE

        status["megatron_have_te"] = bool(HAVE_TE)
    except Exception as exc:  # noqa: BLE001
        status["megatron_have_te"] = False
        status["megatron_have_te_error"] = f"{type(exc).__name__}: {exc}"[:500]
    status["usable"] = status["te_pytorch"] and status["megatron_have_te"]
    return status


def _nvidia_smi() -> dict | str:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "absent"
    fields = ("driver_version", "name", "memory.total", "ecc.mode.current", "clocks.max.sm", "power.limit")
    proc = subprocess.run([exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        return f"exit {proc.returncode}: {(proc.stdout + proc.stderr).strip()[:300]}"
    return [dict(zip(fields, (v.strip() for v in line.split(",")))) for line in proc.stdout.strip().splitlines()]


def environment() -> dict:
    """What this machine has, before anything runs on it."""
    env: dict = {"phase": "environment", "python": sys.version.split()[0], "torch": torch.__version__,
                 "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    try:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except Exception as exc:  # noqa: BLE001 - a wheel without NCCL
        env["nccl"] = f"unavailable: {exc}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(device=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1), device_count=torch.cuda.device_count())
    else:
        env["device"] = "cpu"
    env["peak_bf16_tflops"] = device_peak_tflops(env["device"])
    env["nvidia_smi"] = _nvidia_smi()
    try:
        import megatron.core

        env["megatron_core"] = getattr(megatron.core, "__version__", None) or _version("megatron-core")
    except Exception as exc:  # noqa: BLE001
        env["megatron_core"] = f"import failed: {type(exc).__name__}: {exc}"[:500]
    env["te"] = te_status()
    env["packages"] = {name: _present(module, dist) for name, module, dist in (
        ("transformers", "transformers", None), ("safetensors", "safetensors", None),
        ("tokenizers", "tokenizers", None), ("huggingface_hub", "huggingface_hub", "huggingface-hub"),
        ("sglang", "sglang", None), ("sgl_kernel", "sgl_kernel", "sgl-kernel"),
        ("flashinfer", "flashinfer", "flashinfer-python"), ("torch_memory_saver", "torch_memory_saver", "torch-memory-saver"),
        ("apex", "apex", None), ("pydantic", "pydantic", None))}
    # the preflight's own readers (parallel.preflight_host), its GPU health verdict included
    host = host_facts(gpu=torch.cuda.is_available())
    env["ulimit_l"], env["ulimit_n"] = (str(host[key] or "unlimited") for key in ("memlock", "nofile"))
    env["dev_shm_gib"] = None if host["shm_gib"] is None else round(host["shm_gib"], 1)
    smi = host.get("nvidia_smi")
    env["gpu_health"] = gpu_health_problems(smi["gpus"]) if isinstance(smi, dict) else smi
    env["NVIDIA_TF32_OVERRIDE"] = os.environ.get("NVIDIA_TF32_OVERRIDE")
    env["ok"] = True
    return env


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
    return {"phase": "parity", "spec": spec, "positions": positions, "max_abs_diff": diff, "ok": diff <= PARITY_ATOL,
            "NVIDIA_TF32_OVERRIDE": os.environ.get("NVIDIA_TF32_OVERRIDE")}


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

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    layout = MegatronLayout(use_distributed_optimizer=True)
    initialize_megatron(layout)
    hf = hf_config_dict(preset, max_position_embeddings=max(seq, 2048))
    start = time.perf_counter()
    chunks = wrap_ddp(build_model_chunks(hf, layout, params_dtype=torch.bfloat16, layer_spec=spec), layout)
    # megarl.training.AdamSettings as a plain object: megarl.config's OptimSettings needs pydantic,
    # which the GPU machine's image need not have (ci/gpu_wheels.sh does not carry it).
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
    del chunks, optimizer
    parallel_state.destroy_model_parallel()
    _cleanup()
    tokens_per_step = micro_batch * micro_batches * seq
    step_s = sum(times) / len(times)
    model_tflops = training_flops_per_token(hf, seq) * tokens_per_step / step_s / 1e12
    return {"phase": "training", "spec": spec, "preset": preset, "seq": seq, "tokens_per_step": tokens_per_step,
            "build_s": round(build_s, 1), "step_s": round(step_s, 3), "tokens_per_s": round(tokens_per_step / step_s),
            "model_tflops": round(model_tflops, 1), "losses": [round(x, 4) for x in losses],
            "peak_memory_gib": round(peak_gib, 1), "ok": all(x == x for x in losses),
            "NVIDIA_TF32_OVERRIDE": os.environ.get("NVIDIA_TF32_OVERRIDE")}


def check_on_rank(spec: str, smoke: bool, json_path: str, fail_phase: str | None = None) -> None:
    """One group of phases for one layer spec on this (single) rank, each recorded in ``json_path``
    as it finishes. The local spec trains before its parity (parity needs transformers); the TE
    spec checks parity first (run under ``NVIDIA_TF32_OVERRIDE=0``)."""
    results = Results(json_path)
    if spec == "worker":
        from tools.gpu_check_worker import worker_check

        worker_check(run_phase, results, fail_phase)
        return
    if spec == "local" and not smoke:
        run_phase(results, "matmul", None, lambda: {"phase": "matmul", "side": MATMUL_SIDE,
                                                     "tflops": round(matmul_tflops(MATMUL_SIDE), 1), "ok": True},
                  fail_phase)
    if smoke:
        train = lambda: training(spec, "tiny-llama", seq=32, micro_batch=2, micro_batches=2, steps=2, warmup=1)  # noqa: E731
    else:
        train = lambda: training(spec, "bench-llama-1b", seq=2048, micro_batch=4, micro_batches=4, steps=5, warmup=2)  # noqa: E731
    check = lambda: parity(spec, "tiny-llama", 64 if smoke else 256)  # noqa: E731
    order = [("training", train), ("parity", check)] if spec == "local" else [("parity", check), ("training", train)]
    for phase, fn in order:
        run_phase(results, phase, spec, fn, fail_phase)


def report_line(r: dict, results: list[dict]) -> str:
    """One human-readable line for a result (``results``: the run so far, for the MFU bounds)."""
    if not r.get("ok", False) and "error" in r:
        where = f"{r['phase']:8s} {r.get('spec', r.get('group', '')):5s}"
        return f"{where} FAILED after {r.get('seconds', '?')} s: {r['error']}"
    if r["phase"] == "environment":
        te = r["te"]
        missing = [k for k, v in r["packages"].items() if v is None]
        health = "not checked (no CUDA)" if r["gpu_health"] is None else r["gpu_health"] or "no faults"
        return (f"env      python {r['python']}, torch {r['torch']} (CUDA {r['cuda']}, NCCL {r['nccl']}) on {r['device']}"
                f" (dense bf16 peak {r['peak_bf16_tflops'] or 'unknown'} TFLOP/s), driver "
                f"{r['nvidia_smi'][0]['driver_version'] if isinstance(r['nvidia_smi'], list) else r['nvidia_smi']}; "
                f"megatron-core {r['megatron_core']}; TE {te['transformer_engine']} (pytorch imports: {te['te_pytorch']}, "
                f"HAVE_TE: {te['megatron_have_te']}); missing {missing}; ulimit -l {r['ulimit_l']} -n {r['ulimit_n']}; "
                f"/dev/shm {r['dev_shm_gib']} GiB; GPU health: {health}")
    if r["phase"] == "parity":
        return (f"parity   {r['spec']:5s} {r['positions']} positions: max |logit diff| {r['max_abs_diff']:.2e} "
                f"(limit {PARITY_ATOL:.0e}) {'ok' if r['ok'] else 'FAILED'}")
    if r["phase"] == "training":
        env = next((x for x in results if x.get("phase") == "environment" and "device" in x), {})
        peak = env.get("peak_bf16_tflops")
        matmul = next((x["tflops"] for x in results if x.get("phase") == "matmul" and "tflops" in x), None)
        bounds = []
        if peak:
            bounds.append(f"MFU {r['model_tflops'] / peak:.1%} of {env['device']}'s {peak:.0f} TFLOP/s")
        if matmul:
            bounds.append(f"{r['model_tflops'] / matmul:.1%} of the measured matmul")
        return (f"training {r['spec']:5s} {r['preset']} seq {r['seq']}: {r['tokens_per_s']} tokens/s, "
                f"{r['step_s']} s/step, {r['model_tflops']} TFLOP/s ({'; '.join(bounds) or 'no peak known'}), "
                f"peak {r['peak_memory_gib']} GiB, build {r['build_s']} s, losses {r['losses']}")
    if r["phase"] == "attention":
        return attention_report_line(r)
    if r["phase"] == "matmul":
        return f"matmul   bf16 {r['side']}^3: {r['tflops']} TFLOP/s"
    if r["phase"].startswith("worker "):
        details = {k: v for k, v in r.items() if k not in ("phase", "ok", "seconds")}
        return f"{r['phase']:17s} {'ok' if r['ok'] else 'FAILED'} in {r.get('seconds', '?')} s: {details}"
    if r.get("skipped"):
        return f"{r['phase']:8s} {r.get('group', ''):5s} skipped: {r['skipped']}"
    return json.dumps(r)


def report(results: list[dict]) -> str:
    """Every result's line, in order."""
    return "\n".join(report_line(r, results[: i + 1]) for i, r in enumerate(results))


def _run_group(results: Results, group: str, smoke: bool, fail_phase: str | None, timeout_s: float,
               env: dict[str, str] | None = None) -> None:
    """One group's phases on a fresh rank; a rank that dies or times out is recorded as a failure
    of the group (the phases it finished are in the file already)."""
    from parallel.spawn import run_on_ranks

    start = time.perf_counter()
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})  # also in the spawned rank's environment from its first instruction
    try:
        run_on_ranks(check_on_rank, 1, group, smoke, results.path, fail_phase, timeout_s=timeout_s, env=env)
    except Exception as exc:  # noqa: BLE001 - RankFailedError, RanksTimedOutError, a failed start
        results.add({"phase": "ranks", "group": group, "ok": False, "error": f"{type(exc).__name__}: {exc}"[-4000:],
                     "seconds": round(time.perf_counter() - start, 1)})
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _terminated(signum, frame):  # noqa: ARG001
    # SIGTERM (ci/gpu_check.sh's timeout) as an exception: run_on_ranks' cleanup kills the ranks,
    # which sit in their own process groups and would otherwise keep the GPU.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU too")
    parser.add_argument("--json", help="write the results to this file, phase by phase (else a temporary file)")
    parser.add_argument("--rank-timeout", type=float, default=RANK_TIMEOUT_S,
                        help=f"seconds for each group of phases (local, worker, TE; default {RANK_TIMEOUT_S:.0f})")
    parser.add_argument("--fail-phase", metavar="PHASE[:SPEC[:MODE]]",
                        help="make this phase fail on purpose: raise (the default), exit (its rank dies) or "
                             "hang (until a timeout); "
                             "for the test of the failure handling, e.g. training:local")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; run on a GPU machine, or pass --smoke for the CPU path",
              file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, _terminated)
    tmp_dir = None
    if args.json:
        path = args.json
    else:
        tmp_dir = tempfile.mkdtemp(prefix="megarl-gpu-check.")
        path = os.path.join(tmp_dir, "results.json")
    if os.path.exists(path):
        os.unlink(path)  # this run's results only
    results = Results(path)
    print(f"gpu_check: results go to {path} as each phase finishes", flush=True)
    try:
        env = run_phase(results, "environment", None, environment, args.fail_phase)
        _run_group(results, "local", args.smoke, args.fail_phase, args.rank_timeout)
        _run_group(results, "worker", args.smoke, args.fail_phase, args.rank_timeout)
        te = env.get("te") or te_status()
        if te.get("usable"):
            _run_group(results, "te", args.smoke, args.fail_phase, args.rank_timeout, env={"NVIDIA_TF32_OVERRIDE": "0"})
        else:
            reason = te.get("te_pytorch_error") or ("megatron's HAVE_TE is False" if te.get("te_pytorch") else "no TE")
            results.add({"phase": "te", "group": "te", "ok": True, "skipped": reason})
        run_phase(results, "attention", None, attention_phase, args.fail_phase)
    except SystemExit as exc:  # SIGTERM: the ranks are gone (run_on_ranks' cleanup); say so in the file
        results.add({"phase": "gpu_check", "ok": False, "error": f"terminated (exit {exc.code}), e.g. by the shell's timeout"})
        raise
    final = results.load()
    failed = [f"{r['phase']}:{r.get('spec', r.get('group', ''))}" for r in final if not r.get("ok", False)]
    print(f"gpu_check: {len(final)} results, {'failed: ' + ', '.join(failed) if failed else 'all ok'} ({path})", flush=True)
    if tmp_dir:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
