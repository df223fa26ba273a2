"""The resharding plan against SGLang's own loaders: for every family and layout, each SGLang
TP rank's tensors produced by executing the plan from Megatron shards must equal, element for
element, what SGLang's model class holds after its own load_weights of the same checkpoint.
Every parameter is compared; none is skipped. MoE families: every Megatron EP/ETP/TP/PP layout
into SGLang's fused experts at every (TP, EP) tried."""

import pytest
import torch

from model_specs.presets import save_tiny_hf_model
from parallel.checkpoint.hf_io import HFCheckpoint
from parallel.layout import MegatronLayout
from parallel.reshard.execute import execute_plan_in_memory
from parallel.reshard.plan import megatron_device_positions, plan_megatron_to_sglang
from parallel.shards import megatron_shards
from tests.parallel.reshard.test_plan import materialise
from tests.sglang_oracle import sglang_all_rank_parameters, sglang_oracle_batch

# Each family; tied and untied; qkv bias; GQA with KV=1 and KV=2; vocab not a multiple of 64.
MODELS = {
    "tiny-llama": {},                       # untied, vocab 200, KV=2
    "tiny-llama-tied": {},                  # tied, vocab 256
    "tiny-qwen2": {},                       # qkv bias, tied, KV=1
    "tiny-qwen2-untied": {},                # qkv bias, untied, vocab 250
    "tiny-qwen3": {},                       # q/k norm, vocab 300
    "tiny-mistral": {},
    "tiny-qwen3-moe": {},                   # 4 experts, expert ffn 32 (SGLang's MoE classes do not tie)
    "tiny-mixtral": {"tie_word_embeddings": False},
}
LAYOUTS = {"tp1": (MegatronLayout(), 1), "tp2": (MegatronLayout(tp=2), 2),
           "tp2_pp2": (MegatronLayout(tp=2, pp=2), 4), "pp2_vpp2": (MegatronLayout(pp=2, vpp=2), 2)}


ROLLOUT_TPS = (1, 2, 4)
SP = {"tp": 2, "sequence_parallel": True}
MOE_LAYOUTS = {"ep1": (MegatronLayout(), 1), "ep2": (MegatronLayout(ep=2), 2), "ep2_tp2": (MegatronLayout(ep=2, **SP), 2),
               "ep2_etp2_tp2": (MegatronLayout(ep=2, etp=2, **SP), 4), "ep2_pp2": (MegatronLayout(ep=2, pp=2), 4)}
MOE_ROLLOUTS = ((1, 1), (2, 1), (2, 2), (4, 2), (4, 4))  # SGLang (TP, EP)


def rollouts(model):
    """(SGLang TP, EP) pairs and Megatron layouts tested for ``model``."""
    if "moe" in model or "mixtral" in model:
        return MOE_ROLLOUTS, MOE_LAYOUTS
    return [(tp, 1) for tp in ROLLOUT_TPS], LAYOUTS


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {model: save_tiny_hf_model(model, tmp_path_factory.mktemp(model) / "hf", seed=21, **overrides)
             for model, overrides in MODELS.items()}
    sglang_oracle_batch([(path, tp, ep) for model, path in paths.items() for tp, ep in rollouts(model)[0]])  # one process
    return paths


@pytest.mark.parametrize("model", list(MODELS))
def test_planned_shards_equal_sglang_loaders(checkpoints, model):
    ckpt = HFCheckpoint(checkpoints[model])
    hf, hf_tensors = ckpt.config, ckpt.read_all()
    compared = 0
    pairs, layouts = rollouts(model)
    for rollout_tp, rollout_ep in pairs:
        oracle = sglang_all_rank_parameters(str(ckpt.path), rollout_tp, rollout_ep)
        for layout_name, (layout, world) in layouts.items():
            if hf["num_key_value_heads"] % layout.tp:
                continue  # megatron cannot split these KV heads
            plan = plan_megatron_to_sglang(hf, layout, world, rollout_tp, rollout_ep=rollout_ep)
            plan.check()
            shards = megatron_shards(hf, layout)
            sources = {
                device: {(index, name): tensor for index, chunk in enumerate(shards[position])
                         for name, tensor in materialise(chunk, hf_tensors).items()}
                for device, position in megatron_device_positions(layout, world).items()
            }
            buffers = {device: {name: torch.full(t.shape, float("nan")) for name, t in tensors.items()}
                       for device, tensors in plan.destinations.items()}
            execute_plan_in_memory(plan, sources, buffers)
            for device, tensors in buffers.items():
                expected = oracle[device % rollout_tp]
                case = f"{layout_name}->tp{rollout_tp}ep{rollout_ep} device {device}"
                assert tensors.keys() == expected.keys(), case
                for name, tensor in tensors.items():
                    assert torch.equal(tensor, expected[name]), f"{case}: {name}"
                    compared += 1
    assert compared > 0
