"""Shared helpers: the quickstart config with its data file pointed at a temp file."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import CONFIGS_DIR, ConfigError, load_config

QUICKSTART = CONFIGS_DIR / "quickstart_grpo.yaml"
# The batch the validation tests' expected messages are written for (the quickstart's own batch
# is tuned for learning and may change): 8 prompts x 4 samples, micro-batches of 4.
SMALL_BATCH = ["data.batch_size=8", "rollout.n=4", "actor.micro_batch_size=4", "ref.micro_batch_size=4"]


@pytest.fixture
def data_file(tmp_path: Path) -> str:
    """An existing prompt file (validation only checks that it exists)."""
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "1+1=", "data_source": "synthetic_arith", "reward_model": {"ground_truth": "2"}}\n')
    return str(path)


@pytest.fixture
def problems(data_file):
    """``problems(*overrides)``: the ConfigError lines of the quickstart config with overrides
    (the data file already pointed at a temp file); fails the test if the config is accepted."""

    def run(*overrides: str, path: Path = QUICKSTART, check_files: bool = True) -> list[str]:
        with pytest.raises(ConfigError) as info:
            load_config(path, [f"data.train_files=[{data_file}]", *SMALL_BATCH, *overrides], check_files=check_files)
        assert str(info.value) == "\n".join(info.value.problems)
        assert all("\n" not in line for line in info.value.problems)
        return info.value.problems

    return run
