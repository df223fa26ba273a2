"""Which files an HF checkpoint directory is read from: with ``model.safetensors.index.json``
exactly the shards its weight_map names (what HF transformers loads), without one every
``*.safetensors`` file, and never a tensor settled silently between two files."""

import json

import pytest
import torch
from safetensors.torch import save_file

from parallel.checkpoint.errors import CheckpointError
from parallel.checkpoint.hf_io import HFCheckpoint, write_hf_checkpoint

NAMES = ["a.weight", "b.weight", "c.weight"]


def _save(directory, value, max_shard_bytes):
    """A checkpoint of three 4x4 tensors filled with ``value``, sharded by ``max_shard_bytes``
    (64: one tensor per shard, with an index)."""
    tensors = {name: torch.full((4, 4), value + i, dtype=torch.float32) for i, name in enumerate(NAMES)}
    specs = {name: ((4, 4), torch.float32) for name in NAMES}
    write_hf_checkpoint(directory, {"model_type": "llama"}, iter(tensors.items()), specs, max_shard_bytes=max_shard_bytes)
    return tensors


def _index(directory):
    return json.loads((directory / "model.safetensors.index.json").read_text())


def test_index_decides_which_shards_are_read(tmp_path):
    """A newer save (2 shards) copied over an older one (3 shards) leaves the old third shard
    behind, and the old first shard too when the new save names its shards differently: only
    the files the index names are read, as HF transformers does."""
    old, new = tmp_path / "old", tmp_path / "new"
    _save(old, 100.0, max_shard_bytes=64)  # model-0000{1,2,3}-of-00003: every tensor, old values
    fresh = _save(new, 0.0, max_shard_bytes=128)  # model-0000{1,2}-of-00002
    for stale in sorted(old.glob("*.safetensors")):
        (new / stale.name).write_bytes(stale.read_bytes())
    assert len(list(new.glob("*.safetensors"))) == 5
    ckpt = HFCheckpoint(new, check_tensors=False)
    assert sorted(ckpt.names) == NAMES
    for name, tensor in fresh.items():
        assert torch.equal(ckpt.read(name), tensor), f"{name} read from a stale shard"


def test_missing_indexed_shard_is_refused_naming_it(tmp_path):
    _save(tmp_path / "ckpt", 0.0, max_shard_bytes=64)
    (tmp_path / "ckpt" / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors.*missing"):
        HFCheckpoint(tmp_path / "ckpt", check_tensors=False)


def test_index_entry_naming_a_tensor_its_file_lacks_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    _save(ckpt, 0.0, max_shard_bytes=64)
    index = _index(ckpt)
    index["weight_map"]["b.weight"] = "model-00001-of-00003.safetensors"  # holds a.weight only
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"b\.weight.*model-00001-of-00003\.safetensors"):
        HFCheckpoint(ckpt, check_tensors=False)


def test_tensor_in_two_files_without_an_index_is_refused_naming_both(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"a.weight": torch.zeros(2), "b.weight": torch.zeros(2)}, str(ckpt / "model.safetensors"))
    save_file({"b.weight": torch.ones(2)}, str(ckpt / "extra.safetensors"))
    with pytest.raises(CheckpointError, match=r"b\.weight.*extra\.safetensors.*model\.safetensors"):
        HFCheckpoint(ckpt, check_tensors=False)
    (ckpt / "extra.safetensors").unlink()
    save_file({"c.weight": torch.ones(2)}, str(ckpt / "extra.safetensors"))  # disjoint files: both read
    assert sorted(HFCheckpoint(ckpt, check_tensors=False).names) == ["a.weight", "b.weight", "c.weight"]


def test_a_failed_check_publishes_nothing(tmp_path):
    """``write_hf_checkpoint(check=...)`` runs the check on the complete checkpoint in its temporary
    directory (what the export's verification and logit probe do); when it raises, neither the
    target nor the temporary directory is left."""
    seen = []

    def check(directory):
        seen.append(sorted(p.name for p in directory.iterdir()))
        assert HFCheckpoint(directory, check_tensors=False).names  # a complete checkpoint, readable
        raise CheckpointError("probe failed")

    specs = {name: ((4, 4), torch.float32) for name in NAMES}
    tensors = ((name, torch.zeros(4, 4)) for name in NAMES)
    with pytest.raises(CheckpointError, match="probe failed"):
        write_hf_checkpoint(tmp_path / "out", {"model_type": "llama"}, tensors, specs, partial=tmp_path / ".out.partial",
                            check=check)
    assert seen and "model.safetensors" in seen[0]
    assert list(tmp_path.iterdir()) == []
