"""parallel.checkpoint.atomic: a published file or directory is complete or absent, and a failed
write leaves neither the target nor a temporary behind."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from parallel.checkpoint.atomic import atomic_directory, atomic_file
from parallel.checkpoint.errors import CheckpointError


def test_atomic_file_publishes_the_written_file(tmp_path):
    target = tmp_path / "sub" / "state.pt"  # the directory is created
    with atomic_file(target) as tmp:
        assert tmp.parent == target.parent and tmp != target and not target.exists()
        torch.save({"step": 3}, tmp)
    assert torch.load(target)["step"] == 3
    assert os.listdir(target.parent) == ["state.pt"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask  # not mkstemp's private 0600


def test_atomic_file_replaces_an_existing_target(tmp_path):
    target = tmp_path / "config.yaml"
    target.write_text("old\n")
    with atomic_file(target) as tmp:
        tmp.write_text("new\n")
    assert target.read_text() == "new\n"
    assert os.listdir(tmp_path) == ["config.yaml"]


def test_atomic_file_failure_leaves_no_file_and_no_temp(tmp_path):
    target = tmp_path / "rollouts.jsonl"
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_file(target) as tmp:
            tmp.write_text("half a line")
            raise RuntimeError("disk full")
    assert os.listdir(tmp_path) == []


def test_atomic_file_failure_keeps_the_old_target(tmp_path):
    target = tmp_path / "resolved_config.yaml"
    target.write_text("complete\n")
    with pytest.raises(KeyboardInterrupt):
        with atomic_file(target) as tmp:
            tmp.write_text("trunc")
            raise KeyboardInterrupt
    assert target.read_text() == "complete\n"
    assert os.listdir(tmp_path) == ["resolved_config.yaml"]


def test_atomic_directory_random_and_fixed_partial_names(tmp_path):
    with atomic_directory(tmp_path / "ckpt") as tmp:
        assert tmp.name.startswith(".ckpt.tmp-")
        (tmp / "a.txt").write_text("a")
    assert (tmp_path / "ckpt" / "a.txt").read_text() == "a"
    with pytest.raises(CheckpointError, match="already exists"):
        with atomic_directory(tmp_path / "ckpt"):
            pass

    partial = tmp_path / ".step_2.partial"
    partial.mkdir()
    (partial / "left_by_a_killed_save").write_text("x")
    with pytest.raises(RuntimeError):
        with atomic_directory(tmp_path / "step_2", partial=partial) as tmp:
            assert tmp == partial and list(tmp.iterdir()) == []  # the stale content is gone
            (tmp / "half").write_text("x")
            raise RuntimeError("worker died")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    with atomic_directory(tmp_path / "step_2", partial=partial) as tmp:
        (tmp / "state.json").write_text("{}")
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "step_2"] and (tmp_path / "step_2" / "state.json").is_file()
    with pytest.raises(ValueError, match="beside"):
        with atomic_directory(tmp_path / "step_3", partial=tmp_path / "ckpt" / ".step_3.partial"):
            pass
