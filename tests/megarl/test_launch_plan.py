"""The memory planner against hand computations, HF's parameter counts and megatron's built
models, and the launch scripts' dry runs (70B dense, Qwen3 MoE).

Hand numbers are for tiny-llama (hidden 64, ffn 128, 4 layers, 4 query / 2 KV heads of 16,
vocab 200, untied) and tiny-qwen3-moe (the same attention plus q/k norms, 4 experts of 32, top-2,
vocab 300), worked out in the comments from the formulas in parallel/memory.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.cli import main
from model_specs.presets import hf_config_dict
from parallel.layout import MegatronLayout
from parallel.memory import (
    GiB,
    ModelShape,
    kv_bytes_per_token,
    megatron_stage_expert_params,
    megatron_stage_params,
    rollout_memory,
    sglang_rank_weight_params,
    training_memory,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = hf_config_dict("tiny-llama")
MOE = hf_config_dict("tiny-qwen3-moe")
GRPO_70B = str(ROOT / "configs/llama3_70b_grpo_32x8.yaml")
PPO_70B = str(ROOT / "configs/llama3_70b_ppo_32x8.yaml")


def test_total_params_equal_hf_numel():
    from transformers import AutoModelForCausalLM

    from model_specs.presets import make_hf_config

    for preset in ("tiny-llama", "tiny-llama-tied", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-mixtral"):
        model = AutoModelForCausalLM.from_config(make_hf_config(preset))
        assert ModelShape.from_hf(hf_config_dict(preset)).total_params() == sum(p.numel() for p in model.parameters()), preset


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_moe_parameter_counts_equal_hf_models_on_the_meta_device(preset):
    import torch
    from transformers import AutoModelForCausalLM

    from model_specs.presets import make_hf_config

    with torch.device("meta"):  # shapes only: no memory
        model = AutoModelForCausalLM.from_config(make_hf_config(preset))
    assert ModelShape.from_hf(hf_config_dict(preset)).total_params() == sum(p.numel() for p in model.parameters())


def test_llama3_70b_parameter_count():
    assert ModelShape.from_hf(hf_config_dict("llama3-70b")).total_params() == 70_553_706_496  # Meta's 70.6B


def test_megatron_stage_params_by_hand():
    shape = ModelShape.from_hf(TINY)
    layout = MegatronLayout(tp=2, pp=2)
    # per layer: q 64*64 + k 64*32 + v 64*32 + o 64*64 + mlp 3*64*128 = 36864 split, 2*64 norms
    # tp=2: 18432 + 128 = 18560 per layer, 2 layers per stage = 37120
    # vocab 200 padded to a multiple of 128*2 = 256, / tp = 128 rows of 64 = 8192
    assert megatron_stage_params(shape, layout, 0) == 37120 + 8192  # + embedding
    assert megatron_stage_params(shape, layout, 1) == 37120 + 64 + 8192  # + final norm + output layer
    assert megatron_stage_params(shape, layout, 1, value_head=True) == 37120 + 64 + 64


def _rank_numels(cases):
    """Parameters megatron builds on this rank for each (hf, layout), one after the other."""
    from megatron.core import parallel_state

    from parallel.models import build_model_chunks
    from parallel.process_groups import initialize_megatron

    numels = []
    for hf, layout in cases:
        initialize_megatron(layout)
        numels.append(sum(p.numel() for c in build_model_chunks(hf, layout) for p in c.parameters()))
        parallel_state.destroy_model_parallel()
    return numels


def test_megatron_stage_params_equal_built_model():
    """The closed form equals what megatron-core builds on each rank (tp=2: vocab padding, TP
    splits, replicated norms, embedding + final norm + output layer on the one stage; MoE at ep=2
    and at tp=2 x ep=2: the router replicated, half the experts per rank)."""
    from parallel.spawn import run_on_ranks

    cases = [(TINY, MegatronLayout(tp=2)), (MOE, MegatronLayout(ep=2)),
             (MOE, MegatronLayout(tp=2, ep=2, sequence_parallel=True))]
    for rank, numels in enumerate(run_on_ranks(_rank_numels, 2, cases, timeout_s=240)):
        assert numels[0] == megatron_stage_params(ModelShape.from_hf(TINY), cases[0][1], 0) == 4 * 18560 + 8192 + 64 + 8192
        for (hf, layout), numel in zip(cases[1:], numels[1:]):
            assert numel == megatron_stage_params(ModelShape.from_hf(hf), layout, 0), (rank, layout)


def test_moe_training_memory_by_hand():
    """tiny-qwen3-moe at ep=2 over 2 ranks (dp=2), bf16, distributed optimizer."""
    layout = MegatronLayout(ep=2, use_distributed_optimizer=True)
    shape = ModelShape.from_hf(MOE)
    # per layer: attention 4096 + 2048 + 2048 + 4096 = 12288; norms 2*64 + q/k norms 2*16 + router
    # 4*64 = 416; experts 4 x 3*64*32 = 24576, half per rank = 12288 -> 24992, x 4 layers = 99968
    # vocab 300 -> 384 rows: embedding and output layer 24576 each, final norm 64
    params, experts = 99968 + 2 * 24576 + 64, 4 * 12288
    assert megatron_stage_params(shape, layout, 0) == params
    assert megatron_stage_expert_params(shape, layout) == experts
    est = training_memory(MOE, layout, dp=2, dtype="bfloat16", tokens_per_micro_batch=32, micro_batches=2)
    assert est.expert_params == experts
    # Adam (12 B/param): dense states sharded over dp=2, the experts' over their data-parallel
    # size tp*cp*dp/(ep*etp) = 1 (not sharded)
    assert est.components["optimizer"] == (params - experts) * 12 // 2 + experts * 12
    # per token and layer: 4*64 replicated + (2*64 + 2*32) attention + top-2 x (3*32 + 2*64) + 4 router
    # logits = 900 elements; 32 tokens x 4 layers, bf16
    assert est.components["activations"] == 900 * 32 * 4 * 2
    # SGLang at tp=2 (any ep): attention and experts split in two, norms and router whole, vocab 320/2
    per_layer = 12288 // 2 + 24576 // 2 + 416
    assert sglang_rank_weight_params(shape, 2) == 4 * per_layer + 2 * 160 * 64 + 64


def test_training_memory_by_hand():
    layout = MegatronLayout(tp=2, pp=2, sequence_parallel=True, use_distributed_optimizer=True)
    est = training_memory(TINY, layout, dp=2, dtype="bfloat16", tokens_per_micro_batch=2 * 32, micro_batches=4)
    # Busiest rank: stage 0 (2 micro-batches in flight). 45312 params.
    params = 37120 + 8192
    # activations per token per layer, SP over tp=2: 4*64/2 + (2*64 + 2*32 + 3*128)/2 = 416 elements
    per_layer = 416 * 64 * 2  # 64 tokens, bf16
    assert est.components == {
        "params": params * 2,
        "grads": params * 4,
        "optimizer": params * 12 // 2,  # fp32 master + 2 moments, sharded over dp=2
        "activations": 2 * 2 * per_layer,  # 2 layers x min(pp - 0, 4) = 2 in flight
        "logits": 0,  # on the last stage only
    }
    # Without the distributed optimizer nothing is sharded; without SP the 4h part is replicated.
    plain = MegatronLayout(tp=2, pp=2)
    est = training_memory(TINY, plain, dp=2, dtype="bfloat16", tokens_per_micro_batch=64, micro_batches=4)
    assert est.components["optimizer"] == params * 12
    assert est.components["activations"] == 2 * 2 * (4 * 64 + 288) * 64 * 2
    # Last stage alone (pp=1): one micro-batch in flight and the logits: 64 tokens x 256/2 x (2 + 8).
    one = MegatronLayout(tp=2, sequence_parallel=True)
    est = training_memory(TINY, one, dp=1, dtype="bfloat16", tokens_per_micro_batch=64, micro_batches=4)
    assert est.components["activations"] == 4 * per_layer
    assert est.components["logits"] == 64 * 128 * 10
    # Full recompute: each layer's input (64/2 elements per token) kept, plus one layer's full set.
    est = training_memory(TINY, one, dp=1, dtype="bfloat16", tokens_per_micro_batch=64, micro_batches=4,
                          recompute="full")
    assert est.components["activations"] == 4 * 32 * 64 * 2 + per_layer
    # Reference (forward only): params only, one layer's working set.
    est = training_memory(TINY, one, dp=1, dtype="bfloat16", tokens_per_micro_batch=64, micro_batches=4,
                          trainable=False)
    assert set(est.components) == {"params", "activations", "logits"}
    assert est.components["activations"] == per_layer
    # fp32: no master copy (8 bytes of moments per parameter).
    est = training_memory(TINY, one, dp=1, dtype="float32", tokens_per_micro_batch=64, micro_batches=1)
    assert est.components["optimizer"] == est.components["params"] // 4 * 8


def test_attention_memory_by_hand():
    """What the core attention keeps on top of test_training_memory_by_hand's activations: nothing
    for SDPA; for the context-parallel and shared-prefix attentions (SDPA with a boolean mask, on
    torch's memory-efficient kernel) the mask as an additive bias shared by the heads, K and V
    with the query's heads, and SDPA's own copy of its output."""
    one = MegatronLayout(tp=2, sequence_parallel=True)
    per_layer = 416 * 64 * 2  # as above: 64 tokens, bf16, tp=2 with SP

    def activations(layout=one, dtype="bfloat16", **attention):
        return training_memory(TINY, layout, dp=1, dtype=dtype, tokens_per_micro_batch=64, micro_batches=4,
                               **attention).components["activations"]

    # TINY: 4 query heads and 2 KV heads of 16 (q 64, kv 32 elements per token), tp=2
    bias = 64 * 32 * 2  # a bf16 bias per query token and key: 64 tokens x 32 keys x 2 bytes
    kept = (2 * 64 - 2 * 32 + 64) // 2 * 64 * 2  # K, V at 64 instead of 32, the output again; /tp
    assert activations(attention="sdpa", sequence_length=32) == activations() == 4 * per_layer
    assert activations(attention="context_parallel", sequence_length=32) == 4 * (per_layer + bias + kept)
    assert activations(attention="shared_prefix", sequence_length=32) == 4 * (per_layer + bias + kept)
    # keys padded to a multiple of 16 in the bias: 33 -> 48
    assert activations(attention="shared_prefix", sequence_length=33) == 4 * (per_layer + 64 * 48 * 2 + kept)
    # cp=2: 32 tokens per rank, each over all 32 keys; the rank keeps K and V of all 64 tokens
    cp2 = MegatronLayout(tp=2, cp=2, sequence_parallel=True)
    cp2_kept = (2 * 64 * 64 - 2 * 32 * 32 + 32 * 64) // 2 * 2
    assert activations(cp2, attention="context_parallel", sequence_length=32) == 4 * (
        per_layer // 2 + 32 * 32 * 2 + cp2_kept)
    # fp32: 4 bytes per activation and per bias entry
    assert activations(dtype="float32", attention="context_parallel", sequence_length=32) == 4 * (
        416 * 64 * 4 + 4 * 64 * 32 + kept * 2)
    with pytest.raises(ValueError, match="pass sequence_length"):
        activations(attention="context_parallel")
    with pytest.raises(ValueError, match="attention='flash'; use one of"):
        activations(attention="flash")


def test_shared_prefix_attention_refuses_head_dims_its_kernel_refuses():
    """torch's memory-efficient kernel needs head_dim a multiple of 8 in 16-bit dtypes, of 4 in
    fp32 (check_head_dim_size_mem_efficient): the plan names the field and the fix."""
    odd = dict(TINY, head_dim=12)

    def plan(dtype, attention="shared_prefix"):
        return training_memory(odd, MegatronLayout(), dp=1, dtype=dtype, tokens_per_micro_batch=64,
                               micro_batches=1, attention=attention, sequence_length=32)

    with pytest.raises(ValueError, match="head_dim is 12: set actor.shared_prompts=false"):
        plan("bfloat16")
    assert plan("float32").components["activations"] > plan("float32", "sdpa").components["activations"]
    assert plan("bfloat16", "context_parallel").components["activations"] > 0


def test_plan_attention_follows_the_rows():
    """The plan builds the attention layer_spec would (parallel.models.core_attention_kind) and
    sizes its memory: 70B GRPO, actor stage 0 = 20 layers x 4 micro-batches of 2 x 3072 tokens."""
    from megarl.config import load_config
    from megarl.launch_plan import format_plan, plan_run

    def actor(*overrides):
        plan = plan_run(load_config(GRPO_70B, overrides, check_files=False), gpu_memory_gib=80)
        return next(r for r in plan.roles if r.role == "actor"), plan

    shared, plan = actor()  # rollout.n=8: shared-prompt rows by default
    assert "shared_prefix attention" in format_plan(plan) and plan.fits
    plain, _ = actor("actor.shared_prompts=false")
    packed, plan = actor("actor.sequence_packing=true")
    assert (shared.attention, plain.attention, packed.attention) == ("shared_prefix", "sdpa", "context_parallel")
    tokens = 20 * 4 * 2 * 3072  # (layer, token) pairs kept at once
    pairs = tokens * 3072  # (layer, query token, key)
    # 64 query and 8 KV heads of 128 at tp=8: K and V at 1024 elements a token instead of 128,
    # and SDPA's copy of its output (1024)
    kept = tokens * (2 * 1024 - 2 * 128 + 1024) * 2
    acts = plain.memory.components["activations"]
    assert shared.memory.components["activations"] == acts + pairs * 2 + kept  # bf16 mask
    assert packed.memory.components["activations"] == acts + pairs * 2 + kept  # bf16 bias of the causal mask
    assert plan.fits


def test_rollout_memory_by_hand():
    shape = ModelShape.from_hf(TINY)
    # SGLang tp=2: per layer 64*(32 + 2*16) + 32*64 + 3*64*128/2 + 128 = 18560; vocab padded to
    # 256 (multiple of 64) / 2 = 128 rows, embedding and lm_head; final norm 64.
    assert sglang_rank_weight_params(shape, 2) == 4 * 18560 + 2 * 128 * 64 + 64
    # KV per token: 2 x 4 layers x 1 KV head per rank x 16 x 2 bytes; tp=4 > 2 KV heads: replicated.
    assert kv_bytes_per_token(shape, 2) == 256
    assert kv_bytes_per_token(shape, 4) == 256
    assert kv_bytes_per_token(shape, 1) == 512
    rm = rollout_memory(TINY, 2, free_bytes=10 * 2**20, mem_fraction_static=0.5, sequences_per_engine=8,
                        tokens_per_sequence=100)
    weights = (4 * 18560 + 2 * 128 * 64 + 64) * 2
    assert (rm.weights, rm.reserved, rm.kv_pool) == (weights, 5 * 2**20, 5 * 2**20 - weights)
    assert rm.kv_capacity_tokens == (5 * 2**20 - weights) // 256
    assert rm.tokens_needed == 800 and rm.concurrency_fraction == 1.0


def test_plan_70b_numbers(capsys):
    """The 70B GRPO layout: 2.27B parameters on the busiest rank; fits in 80 GiB."""
    from megarl.config import load_config
    from megarl.launch_plan import plan_run

    plan = plan_run(load_config(GRPO_70B, check_files=False), gpu_memory_gib=80)
    actor = next(r for r in plan.roles if r.role == "actor")
    # 20 layers + the embedding (vocab 128256 padded to a multiple of 128*8: 129024), tp=8
    params = 20 * (855_638_016 // 8 + 2 * 8192) + 129024 * 8192 // 8
    assert actor.memory.components["params"] == params * 2
    assert actor.memory.components["optimizer"] == params * 12 // 8
    assert actor.dp == 8
    rollout = next(r for r in plan.roles if r.role == "rollout")
    assert rollout.engines == 32 and rollout.rollout.kv_per_token == 2 * 80 * 1 * 128 * 2
    assert plan.fits and 40 * GiB < plan.pools[0].peak < 80 * GiB


@pytest.mark.parametrize("script", ["grpo_llama70b.sbatch", "ppo_llama70b.sbatch", "convert_llama70b.sbatch"])
def test_dry_runs_of_70b_scripts(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    result = subprocess.run(["bash", str(ROOT / "launch_scripts" / script), "--dry-run"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "tp=8 pp=4" in out and "== the job would run" in out and "sbatch" in out
    if script.startswith("convert"):
        assert "1.4 GiB per rank" in out and "rank 0 of megatron-to-hf 5.3 GiB" in out
        assert "srun --nodes=4 --ntasks-per-node=8" in out and "megarl convert hf-to-megatron" in out
    else:
        assert "verdict: fits in memory" in out and "GiB" in out and "rollout" in out
        assert "launch_scripts/ray_on_slurm.sh megarl train configs/llama3_70b_" in out
        assert "--slurm-nodes 32 --slurm-gpus-per-node 8" in out
        if script.startswith("ppo"):
            assert "critic" in out and "critic update" in out


@pytest.mark.parametrize("config, nodes, layout", [
    (None, 1, "tp=1 pp=1 cp=1 dist-opt ep=8"),
    ("configs/qwen3_235b_a22b_grpo_16x8.yaml", 16, "tp=4 pp=2 cp=1 sp dist-opt ep=16")])
def test_dry_runs_of_the_qwen3_moe_script(config, nodes, layout, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    if config:
        env.update(MEGARL_CONFIG=config, MEGARL_NODES=str(nodes))
    result = subprocess.run(["bash", str(ROOT / "launch_scripts/grpo_qwen3_moe.sbatch"), "--dry-run"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=120)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert layout in out and "SGLang tp=8 ep=8" in out and "128 experts" in out and "experts" in out
    assert "of 141 GiB: fits" in out and "verdict: fits in memory" in out
    assert f"--slurm-nodes {nodes} --slurm-gpus-per-node 8" in out and "megarl train configs/qwen3_" in out


def test_dry_run_env_knob_and_overrides(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(MEGARL_DRY_RUN="1", PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
    result = subprocess.run(["bash", str(ROOT / "launch_scripts/grpo_llama70b.sbatch"), "actor.micro_batch_size=16"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr  # flagged: does not fit
    assert "DOES NOT FIT" in result.stdout and "actor.micro_batch_size" in result.stdout


def _plan(capsys, *argv):
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_bad_tp_names_field_value_and_fix(capsys):
    code, _, err = _plan(capsys, GRPO_70B, "actor.layout.tp=16")  # 256 ranks divide, 8 KV heads do not
    assert code == 2
    assert "actor.layout.tp=16 must divide num_attention_heads=64 and num_key_value_heads=8" in err
    assert "pick tp from [1, 2, 4, 8]" in err


def test_world_not_divisible_names_field_value_and_fix(capsys):
    code, _, err = _plan(capsys, GRPO_70B, "cluster.nodes=3")
    assert code == 2
    assert "world_size=24 is not divisible by tp*pp*cp=8*4*1=32" in err and "cluster.nodes=3" in err


def test_rollout_tp_not_dividing_heads(capsys):
    code, _, err = _plan(capsys, GRPO_70B, "rollout.tp=3")
    assert code == 2 and "rollout.tp=3" in err and "pick one of" in err


def test_layout_that_does_not_fit_is_flagged(capsys):
    code, out, _ = _plan(capsys, GRPO_70B, "--gpu-memory-gib", "40")
    assert code == 1
    assert "DOES NOT FIT: pool 'global'" in out and "fix:" in out and "verdict: does NOT fit" in out
    # No distributed optimizer on a 70B model: the fix names it.
    code, out, _ = _plan(capsys, GRPO_70B, "actor.layout.use_distributed_optimizer=false", "--gpu-memory-gib", "70")
    assert code == 1 and "set actor.layout.use_distributed_optimizer=true" in out
    # SGLang's reservation smaller than its weights.
    code, out, _ = _plan(capsys, PPO_70B, "rollout.mem_fraction_static=0.3")
    assert code == 1 and "rollout.mem_fraction_static=0.3" in out and "raise it to at least" in out


def test_kv_pool_too_small_for_a_step_warns(capsys):
    code, out, _ = _plan(capsys, PPO_70B, "rollout.n=8")
    assert code == 0 and "warning: rollout: the KV pool holds" in out and "waves" in out


def test_split_pools_and_slurm_geometry(capsys):
    code, out, _ = _plan(capsys, GRPO_70B, "cluster.pools={train: 128, rollout: 128}", "actor.pool=train",
                         "rollout.placement=separate", "rollout.pool=rollout", "rollout.mem_fraction_static=0.85")
    assert code == 0 and "pool 'train' (128 ranks: actor, ref)" in out and "pool 'rollout' (128 ranks: rollout)" in out
    code, _, err = _plan(capsys, GRPO_70B, "--slurm-nodes", "16")
    assert code == 2 and "cluster.nodes=32: the Slurm allocation has 16 nodes" in err


def test_plan_json(capsys):
    import json

    code, out, _ = _plan(capsys, PPO_70B, "--json")
    data = json.loads(out)
    assert code == 0 and data["fits"] and set(data["roles"]) == {"actor", "ref", "critic", "rollout"}
