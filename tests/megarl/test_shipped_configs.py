"""Every shipped run config (configs/*.yaml) plans as fitting with no flags: `megarl plan <config>`
exits 0, the GPU's memory being the config's own ``cluster.gpu_memory_gib`` (configs/cluster/h100.yaml,
h200.yaml), and ``--gpu-memory-gib`` still overrides it."""

from __future__ import annotations

import json

import pytest

from megarl.cli import main
from megarl.config import CONFIGS_DIR, load_config

SHIPPED = sorted(p.name for p in CONFIGS_DIR.glob("*.yaml"))


def _plan(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["plan", *argv, "--json"])
    captured = capsys.readouterr()
    return code, (json.loads(captured.out) if captured.out.strip() else {"stderr": captured.err})


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_plans_as_fitting(name, capsys):
    code, plan = _plan(capsys, str(CONFIGS_DIR / name))
    assert code == 0 and plan["fits"], plan
    budget = load_config(CONFIGS_DIR / name, validate=False).cluster.gpu_memory_gib
    assert plan["budget_bytes"] == int(budget * 2**30)


def test_the_h200_configs_say_so():
    for name in ("qwen3_30b_a3b_grpo_1x8.yaml", "qwen3_235b_a22b_grpo_16x8.yaml"):
        assert load_config(CONFIGS_DIR / name, validate=False).cluster.gpu_memory_gib == 141
    assert load_config(CONFIGS_DIR / "llama3_70b_grpo_32x8.yaml", validate=False).cluster.gpu_memory_gib == 80


def test_gpu_memory_flag_overrides_the_config(capsys):
    moe = str(CONFIGS_DIR / "qwen3_30b_a3b_grpo_1x8.yaml")
    code, plan = _plan(capsys, moe, "--gpu-memory-gib", "80")  # an H100 node: the states alone do not fit
    assert code == 1 and not plan["fits"] and plan["budget_bytes"] == 80 * 2**30
    code, plan = _plan(capsys, moe, "cluster.gpu_memory_gib=80")  # the same, as a config override
    assert code == 1 and plan["budget_bytes"] == 80 * 2**30


def test_gpu_memory_must_be_positive(capsys):
    code = main(["check-config", str(CONFIGS_DIR / "quickstart_grpo.yaml"), "cluster.gpu_memory_gib=0",
                 "--skip-file-checks"])
    err = capsys.readouterr().err
    assert code == 2 and "cluster.gpu_memory_gib=0" in err and "use 80 (H100) or 141 (H200)" in err, err
