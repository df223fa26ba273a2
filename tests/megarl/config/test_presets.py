"""Every YAML under configs/ loads and validates, in the composition it is meant for."""

from __future__ import annotations

import dataclasses

import pytest

from megarl.config import CONFIGS_DIR, load_config

# Each preset file -> the defaults list of a run that uses it (validated with the data file
# pointed at a temp file). A top-level file is loaded as it is. A new YAML under configs/ must
# be added here (test_every_yaml_is_covered).
_QUICK = str(CONFIGS_DIR / "quickstart_grpo.yaml")
_70B = str(CONFIGS_DIR / "llama3_70b_grpo_32x8.yaml")
_30B_MOE = str(CONFIGS_DIR / "qwen3_30b_a3b_grpo_1x8.yaml")
_235B_MOE = str(CONFIGS_DIR / "qwen3_235b_a22b_grpo_16x8.yaml")
COMPOSITIONS = {
    "quickstart_grpo.yaml": None,
    "llama3_70b_grpo_32x8.yaml": None,
    "llama3_70b_ppo_32x8.yaml": None,
    "sft_chat_arith.yaml": None,
    "agent_gsm8k_python.yaml": None,
    "qwen3_30b_a3b_grpo_1x8.yaml": None,
    "qwen3_235b_a22b_grpo_16x8.yaml": None,
    **{f"algorithm/{name}.yaml": [_QUICK, f"algorithm/{name}"]
       for name in ("grpo", "ppo", "dapo", "drgrpo", "rloo", "reinforce_plus_plus", "gspo")},
    "layout/tp1.yaml": [_QUICK, "model/tiny-llama", "layout/tp1", "cluster/local-cpu-4"],
    "layout/tp2.yaml": [_QUICK, "model/tiny-llama", "layout/tp2", "cluster/local-cpu-4"],
    "layout/tp2pp2.yaml": [_QUICK, "model/tiny-llama", "layout/tp2pp2", "cluster/local-cpu-4"],
    "layout/tp2pp2vpp2.yaml": [_QUICK, "model/tiny-llama", "layout/tp2pp2vpp2", "cluster/local-cpu-4"],
    "layout/tp8pp4.yaml": [_70B, "layout/tp8pp4"],
    "model/tiny-qwen2.yaml": [_QUICK, "model/tiny-qwen2"],
    "model/tiny-llama.yaml": [_QUICK, "model/tiny-llama"],
    "model/llama3-70b.yaml": [_70B, "model/llama3-70b"],
    "model/tiny-qwen3-moe.yaml": [_QUICK, "model/tiny-qwen3-moe"],
    "model/qwen3-30b-a3b.yaml": [_30B_MOE, "model/qwen3-30b-a3b"],
    "model/qwen3-235b-a22b.yaml": [_235B_MOE, "model/qwen3-235b-a22b"],
    "cluster/gpu-1x8.yaml": [_30B_MOE, "cluster/gpu-1x8"],
    "cluster/gpu-16x8-split.yaml": [_235B_MOE, "cluster/gpu-16x8-split"],
    "cluster/local-cpu.yaml": [_QUICK, "cluster/local-cpu"],
    "cluster/local-cpu-4.yaml": [_QUICK, "cluster/local-cpu-4"],
    "cluster/gpu-32x8.yaml": [_70B, "cluster/gpu-32x8"],
    "cluster/gpu-32x8-split.yaml": [_70B, "cluster/gpu-32x8-split"],
    "cluster/h100.yaml": [_30B_MOE, "cluster/h100"],  # (an H200 config moved to H100s)
    "cluster/h200.yaml": [_70B, "cluster/h200"],
}
GPU_PRESETS = ("cluster/h100.yaml", "cluster/h200.yaml")  # the GPU's memory, not the cluster's geometry


def _geometry(config) -> dict:
    """The cluster section without the GPU's memory (which cluster/h100 and cluster/h200 set)."""
    return {k: v for k, v in dataclasses.asdict(config.cluster).items() if k != "gpu_memory_gib"}


def _all_yaml() -> list[str]:
    return sorted(str(p.relative_to(CONFIGS_DIR)) for p in CONFIGS_DIR.rglob("*.y*ml"))


def test_every_yaml_is_covered():
    assert _all_yaml() and set(_all_yaml()) == set(COMPOSITIONS)


@pytest.mark.parametrize("name", sorted(COMPOSITIONS))
def test_preset_loads_and_validates(name, tmp_path, data_file):
    defaults = COMPOSITIONS[name]
    if defaults is None:
        path = CONFIGS_DIR / name
    else:
        path = tmp_path / "run.yaml"
        path.write_text("defaults: [" + ", ".join(defaults) + "]\n")
    mode = "sft" if name.startswith("sft") else "rl"  # `megarl sft` configs are validated as it reads them
    config = load_config(path, [f"data.train_files=[{data_file}]"], search_path=[CONFIGS_DIR], mode=mode)
    # The preset's own values are in the result (it was not shadowed by the composition).
    own = load_config(CONFIGS_DIR / name, validate=False)
    if name in GPU_PRESETS:
        assert config.cluster.gpu_memory_gib == own.cluster.gpu_memory_gib  # changed by it (141 <-> 80)
    elif name.startswith(("layout/", "model/", "cluster/")):
        section = name.split("/")[0]
        pick = {"layout": lambda c: (c.actor.layout, c.rollout.tp), "model": lambda c: c.model,
                "cluster": lambda c: (_geometry(c), c.actor.pool, c.rollout.placement)}[section]
        assert pick(config) == pick(own)
    elif name.startswith("algorithm/"):
        assert (config.algorithm, config.actor.policy_loss, config.actor.kl_loss, config.ref.enabled) == (
            own.algorithm, own.actor.policy_loss, own.actor.kl_loss, own.ref.enabled)


def test_the_70b_config_is_the_planned_run(data_file):
    config = load_config(CONFIGS_DIR / "llama3_70b_grpo_32x8.yaml", [f"data.train_files=[{data_file}]"])
    assert config.cluster.world_size == 256 and config.world_size_for("actor") == 256
    layout = config.actor.layout
    assert layout.data_parallel_size(256) == 8 and layout.tp == 8 and layout.pp == 4
    assert config.model.dtype == "bfloat16" and config.rollout.tp == 8
