"""The keys of how megatron trains (``actor.moe_token_dispatcher``, ``actor.recompute``,
``actor.overlap_grad_reduce``): their device-dependent defaults, the model specs every Megatron
model is built from, the refusal of what CPU ranks cannot run, the Megatron workers' environment,
and the launch plan's recompute. The built models: tests/megarl/workers/test_training_settings.py."""

from __future__ import annotations

import pytest

from megarl.cli import main
from megarl.config import CONFIGS_DIR, ClusterConfig, RunConfig
from megarl.controller.model_roles import model_specs
from megarl.controller.worker_group import megatron_worker_env
from parallel.layout import MegatronLayout
from parallel.memory import training_memory
from tests.megarl.config.conftest import QUICKSTART, SMALL_BATCH

GPU = ClusterConfig(gpus_per_node=8)


def _settings(cfg: RunConfig) -> set[tuple]:
    return {(s.role, s.moe_token_dispatcher, s.recompute, s.overlap_grad_reduce) for s in model_specs(cfg, "/m")}


def test_defaults_follow_the_device():
    """auto / null: alltoall and overlapped gradient reduction on GPUs, allgather and none on CPU,
    for every Megatron model of the run (actor, reference, critic)."""
    roles = dict(ref={"enabled": True}, critic={"enabled": True})
    assert _settings(RunConfig(**roles)) == {(r, "allgather", "none", False) for r in ("actor", "ref", "critic")}
    assert _settings(RunConfig(cluster=GPU, **roles)) == {(r, "alltoall", "none", True)
                                                         for r in ("actor", "ref", "critic")}
    chosen = RunConfig(cluster=GPU, actor={"moe_token_dispatcher": "allgather", "recompute": "full",
                                           "overlap_grad_reduce": False})
    assert _settings(chosen) == {("actor", "allgather", "full", False)}
    assert _settings(RunConfig(actor={"recompute": "selective", "overlap_grad_reduce": True})) == {
        ("actor", "allgather", "selective", True)}


def test_alltoall_is_refused_on_cpu_for_an_moe_model(data_file, capsys):
    """megatron-core 0.16's alltoall dispatcher does not run on gloo (docs/cpu.md): refused on CPU
    ranks for an MoE model, by name; a dense model has no dispatcher, a GPU cluster runs it."""
    base = [str(QUICKSTART), f"data.train_files=[{data_file}]", *SMALL_BATCH, "actor.moe_token_dispatcher=alltoall"]
    assert main(["check-config", *base, "model.path=tiny-qwen3-moe"]) == 2
    assert ("actor.moe_token_dispatcher=\"alltoall\": megatron-core 0.16's alltoall dispatcher does not run on CPU "
            "ranks (it hands gloo's all_to_all_single split sizes that gloo refuses: docs/cpu.md); use auto or "
            "allgather on CPU (cluster.gpus_per_node=0)") in capsys.readouterr().err
    assert main(["check-config", *base]) == 0
    assert main(["check-config", *base, "model.path=tiny-qwen3-moe", "actor.moe_token_dispatcher=auto"]) == 0


def test_only_gpu_megatron_workers_get_one_device_connection():
    """CUDA_DEVICE_MAX_CONNECTIONS=1 (kernels in launch order, which megatron's overlap of
    communication and computation relies on) for Megatron workers on GPUs; nothing on CPU."""
    assert megatron_worker_env(RunConfig(cluster=GPU)) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert megatron_worker_env(RunConfig()) == {}


def test_selective_recompute_memory_by_hand():
    """Selective recompute keeps every activation but the core attention's per-key entries (the
    context-parallel attention's here), plus one layer's of them while it is recomputed."""
    from model_specs.presets import hf_config_dict
    from parallel.memory import ModelShape

    hf = hf_config_dict("tiny-llama")
    layout = MegatronLayout(tp=2, pp=2, sequence_parallel=True)

    def activations(recompute, attention="context_parallel"):
        return training_memory(hf, layout, dp=1, tokens_per_micro_batch=64, micro_batches=4, recompute=recompute,
                               attention=attention, sequence_length=32).components["activations"]

    # what the core attention keeps per layer (counted by hand in tests/megarl/test_launch_plan.py)
    kept = ModelShape.from_hf(hf).core_attention_bytes("context_parallel", tp=2, cp=1, dtype_size=2, tokens=64,
                                                       sequence_length=32)
    assert kept > 0
    layers, in_flight = 2, 2  # 4 layers over pp=2; stage 0 holds pp micro-batches in flight
    assert activations("none") - activations("selective") == layers * in_flight * kept - kept
    assert activations("selective", "sdpa") == activations("none", "sdpa")  # nothing to drop
    assert activations("full") < activations("selective")
    with pytest.raises(ValueError, match="recompute='some'; use one of"):
        activations("some")


def test_the_plan_assumes_the_configs_recompute():
    """``megarl plan`` sizes activations with ``actor.recompute`` unless --recompute says otherwise."""
    from megarl.config import load_config
    from megarl.launch_plan import plan_run

    grpo_70b = CONFIGS_DIR / "llama3_70b_grpo_32x8.yaml"

    def actor_activations(*overrides, recompute=None):
        plan = plan_run(load_config(grpo_70b, list(overrides), check_files=False), recompute=recompute)
        return plan.recompute, next(r for r in plan.roles if r.role == "actor").memory.components["activations"]

    full = actor_activations("actor.recompute=full")
    assert full[0] == "full" and full == actor_activations(recompute="full")
    assert actor_activations()[0] == "none" and actor_activations()[1] > full[1]
