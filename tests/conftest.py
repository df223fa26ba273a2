"""Fixtures shared across test directories: tiny HF models and prompt files, each made once per
test session and reused by every test that asks for the same one (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory):
    """``tiny_hf_model(preset, seed=0, reward_model=False, **config_overrides)`` -> the directory of
    a randomly initialised HF checkpoint of that preset (``model_specs.presets.save_tiny_hf_model``),
    built once per session for each distinct request. Tests must not modify it: copy it first."""
    from model_specs.presets import save_tiny_hf_model

    made: dict[str, str] = {}

    def build(preset: str, seed: int = 0, reward_model: bool = False, **overrides) -> str:
        key = json.dumps([preset, seed, reward_model, overrides], sort_keys=True)
        if key not in made:
            path = tmp_path_factory.mktemp(f"{preset}-seed{seed}") / "hf"
            made[key] = str(save_tiny_hf_model(preset, path, seed=seed, reward_model=reward_model, **overrides))
        return made[key]

    return build


@pytest.fixture(scope="session")
def arith_prompts(tmp_path_factory):
    """``arith_prompts(num)`` -> a parquet file of ``num`` synthetic arithmetic prompts (seed 0,
    partial credit 5: the quickstart's data), made once per session for each size."""
    from megarl.data.prepare import write_synthetic_arith

    made: dict[int, str] = {}

    def build(num: int) -> str:
        if num not in made:
            path = Path(tmp_path_factory.mktemp("arith")) / f"arith{num}.parquet"
            write_synthetic_arith(path, num, seed=0, partial_credit_scale=5)
            made[num] = str(path)
        return made[num]

    return build
