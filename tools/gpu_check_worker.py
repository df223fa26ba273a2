"""gpu_check's ``worker`` group: the RL worker's own path on this device, one phase at a time.

``tools.gpu_check`` trains through ``megarl.training`` and checks logits through ``parallel.forward``;
an RL run goes through ``megarl.workers.megatron_worker.MegatronWorker`` instead, which cuts its
micro-batches on the host, runs megatron's schedule, all-reduces its metrics and hands its
outputs to a driver that may have no GPU. This group runs that worker at world size 1 on this
machine's process group (NCCL for CUDA tensors, gloo for host ones: ``parallel.process_groups``)
with a tiny Llama, each step its own phase, so that the first failure names its step:

- ``worker setup``: a reference and an actor (with its optimizer) built from an HF checkpoint;
- ``worker forward``: the reference's log-probs of a rollout batch, on the host, against HF
  transformers' on the CPU (fp32, TF32 off);
- ``worker update``: two PPO updates of the actor (finite metrics, the log-probs move);
- ``worker checkpoint``: the actor saved as distributed checkpoints, updated once more, loaded:
  its log-probs equal those at the save;
- ``worker export``: the actor exported as an HF checkpoint, which HF transformers loads and whose
  log-probs equal the actor's.

A phase after a failed one is recorded as skipped, naming the failure.
"""

from __future__ import annotations

import tempfile

import torch

FORWARD_ATOL = 1e-4  # fp32 log-probs, TF32 off (gpu_check's PARITY_ATOL for logits)
PROMPT, RESPONSE, ROWS = 6, 5, 4


def rollout_batch(vocab_size: int) -> dict:
    """``ROWS`` samples of a prompt and a response of fixed lengths, random tokens and advantages."""
    generator = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, vocab_size, (ROWS, PROMPT + RESPONSE), generator=generator),
        "prompt_lengths": torch.full((ROWS,), PROMPT),
        "response_lengths": torch.full((ROWS,), RESPONSE),
        "advantages": torch.randn(ROWS, RESPONSE, generator=generator),
    }


def hf_logprobs(hf_dir: str, batch: dict) -> torch.Tensor:
    """The oracle: HF transformers' log-prob of each response token, fp32 on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits.log_softmax(-1)
    targets = batch["input_ids"][:, PROMPT:]
    return logits[:, PROMPT - 1: -1].gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _in_order(out: dict) -> torch.Tensor:
    return out["logp"][out["rows"].argsort()]


def worker_check(run_phase, results, fail_phase: str | None) -> None:
    """The ``worker`` group's phases on this (single) rank, each recorded as it finishes;
    ``run_phase`` is gpu_check's (one try block and one record per phase)."""
    from megarl.config.schema import OptimSettings
    from megarl.workers.batch import MicroBatching
    from megarl.workers.losses import LossSettings
    from megarl.workers.megatron_worker import MegatronWorker, ModelSpec
    from model_specs.presets import save_tiny_hf_model
    from parallel.layout import MegatronLayout

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    state: dict = {}
    failed: list[str] = []

    def phase(name: str, fn) -> None:
        if failed:
            results.add({"phase": name, "ok": True, "skipped": f"{failed[0]} failed"})
            return
        result = run_phase(results, name, None, fn, fail_phase)
        if not result.get("ok", False):
            failed.append(name)

    def setup() -> dict:
        hf_dir = save_tiny_hf_model("tiny-llama", state["dir"] + "/hf", seed=1)
        layout, batching = MegatronLayout(), MicroBatching(micro_batch_size=2)
        worker = MegatronWorker()
        worker.setup(ModelSpec("ref", str(hf_dir), layout, batching), seed=7)
        worker.setup(ModelSpec("actor", str(hf_dir), layout, batching, OptimSettings(lr=1e-3, weight_decay=0.0),
                               total_optimizer_steps=4, loss=LossSettings(entropy_coef=0.01)), seed=7)
        state.update(worker=worker, hf_dir=str(hf_dir), batch=rollout_batch(worker.models["actor"].hf_config["vocab_size"]))
        return {"phase": "worker setup", "device": str(worker.models["actor"].device), "ok": True}

    def forward() -> dict:
        out = state["worker"].forward("ref", state["batch"], with_entropy=True)
        devices = sorted({value.device.type for value in out.values()})
        diff = float((_in_order(out) - hf_logprobs(state["hf_dir"], state["batch"])).abs().max())
        return {"phase": "worker forward", "output_devices": devices, "max_abs_diff": diff,
                "ok": devices == ["cpu"] and diff <= FORWARD_ATOL}

    def update() -> dict:
        worker, batch = state["worker"], state["batch"]
        before = _in_order(worker.forward("actor", batch))
        counts = {"tokens": float(ROWS * RESPONSE), "sequences": float(ROWS)}
        metrics = [worker.update("actor", dict(batch, old_logp=before), counts) for _ in range(2)]
        moved = float((_in_order(worker.forward("actor", batch)) - before).abs().max())
        finite = all(value == value and abs(value) != float("inf") for m in metrics for value in m.values())
        state["counts"] = counts
        return {"phase": "worker update", "grad_norms": [round(m["actor/grad_norm"], 4) for m in metrics],
                "logp_moved": moved, "ok": finite and moved > 0}

    def checkpoint() -> dict:
        worker, batch = state["worker"], state["batch"]
        directory = state["dir"] + "/ckpt"
        worker.save_checkpoint(directory)
        saved = _in_order(worker.forward("actor", batch))
        worker.update("actor", batch, state["counts"])
        restored = worker.load_checkpoint(directory)
        diff = float((_in_order(worker.forward("actor", batch)) - saved).abs().max())
        return {"phase": "worker checkpoint", "max_abs_diff": diff, "rng_restored": restored, "ok": diff == 0.0}

    def export() -> dict:
        worker, batch = state["worker"], state["batch"]
        target = state["dir"] + "/export"
        worker.export_hf(target)
        diff = float((_in_order(worker.forward("actor", batch)) - hf_logprobs(target, batch)).abs().max())
        return {"phase": "worker export", "max_abs_diff": diff, "ok": diff <= FORWARD_ATOL}

    with tempfile.TemporaryDirectory() as directory:
        state["dir"] = directory
        try:
            for name, fn in (("worker setup", setup), ("worker forward", forward), ("worker update", update),
                             ("worker checkpoint", checkpoint), ("worker export", export)):
                phase(name, fn)
        finally:
            if "worker" in state:
                state["worker"].shutdown()
