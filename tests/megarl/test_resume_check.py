"""What a resume lets change: where the models run (layouts, cluster: an elastic resume), not the
model, its dtype or which roles run."""

from pathlib import Path

import pytest

from megarl.config.loader import load_config
from megarl.controller.checkpointer import config_fingerprint, resume_changes
from megarl.controller.worker_group import RunError

ROOT = Path(__file__).resolve().parents[2]


def _config(*overrides):
    """The quickstart's config, not validated: only its fingerprint is read."""
    return load_config(ROOT / "configs/quickstart_grpo.yaml", overrides, validate=False)


def test_a_layout_or_cluster_change_is_an_elastic_resume():
    saved = config_fingerprint(_config("actor.layout.tp=2", "cluster.cpu_ranks_per_node=4"))
    assert resume_changes(saved, _config("actor.layout.tp=2", "cluster.cpu_ranks_per_node=4"), Path("c")) == ""
    changed = resume_changes(saved, _config("actor.layout.tp=1", "cluster.cpu_ranks_per_node=2"), Path("c"))
    assert changed.startswith("actor_layout: checkpoint {") and "'tp': 2" in changed and "cluster:" in changed


def test_a_model_or_role_change_is_refused():
    saved = config_fingerprint(_config())
    with pytest.raises(RunError, match=r"config changed \(dtype: checkpoint 'float32', config 'bfloat16'\)"):
        resume_changes(saved, _config("model.dtype=bfloat16", "actor.layout.tp=2"), Path("c"))
