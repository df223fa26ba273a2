"""A checkpoint's manifest names what is wrong with a damaged copy: a truncated, corrupted,
missing or extra file, or no manifest (a save that did not finish)."""

import pytest

from parallel.checkpoint.manifest import MANIFEST_FILE, manifest_problem, write_manifest


@pytest.fixture
def checkpoint(tmp_path):
    (tmp_path / "actor").mkdir()
    (tmp_path / "actor" / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
    (tmp_path / "trainer_state.json").write_text('{"step": 4}')
    return tmp_path


def test_intact_checkpoint_and_each_kind_of_damage(checkpoint):
    manifest = write_manifest(checkpoint)
    assert sorted(manifest["files"]) == ["actor/__0_0.distcp", "trainer_state.json"]
    assert manifest["files"]["actor/__0_0.distcp"]["size"] == 16384
    assert manifest_problem(checkpoint) is None
    shard = checkpoint / "actor" / "__0_0.distcp"
    original = shard.read_bytes()

    flipped = bytearray(original)
    flipped[5000] ^= 1
    shard.write_bytes(bytes(flipped))
    assert manifest_problem(checkpoint) == "actor/__0_0.distcp does not match its checksum at save (corrupted)"
    shard.write_bytes(original[:1000])
    assert manifest_problem(checkpoint) == ("actor/__0_0.distcp has 1000 bytes, 16384 when saved "
                                            "(truncated or overwritten)")
    shard.unlink()
    assert manifest_problem(checkpoint) == "actor/__0_0.distcp is missing"
    shard.write_bytes(original)
    (checkpoint / "stray.pt").write_bytes(b"x")
    assert manifest_problem(checkpoint) == "stray.pt was not written by the save"
    (checkpoint / "stray.pt").unlink()
    assert manifest_problem(checkpoint) is None
    (checkpoint / MANIFEST_FILE).unlink()
    assert "has no megarl_manifest.json" in manifest_problem(checkpoint)


def test_sizes_only_manifest_reads_nothing_back_but_sees_truncation(checkpoint):
    write_manifest(checkpoint, checksums=False)
    shard = checkpoint / "actor" / "__0_0.distcp"
    flipped = bytearray(shard.read_bytes())
    flipped[5000] ^= 1
    shard.write_bytes(bytes(flipped))
    assert manifest_problem(checkpoint) is None  # same size: not detectable without checksums
    shard.write_bytes(bytes(flipped[:-1]))
    assert "has 16383 bytes" in manifest_problem(checkpoint)
