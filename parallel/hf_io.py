"""HF safetensors checkpoints: validated, sliced reads and atomic, streamed writes.

Reading: a checkpoint is checked against its config before any tensor is read (every tensor
the family expects is present with the right shape, nothing unexpected, headers readable), then
tensors are read box by box straight from the files (safetensors slices), so a rank that needs a
shard never loads the whole tensor, let alone the model.

Writing: tensors are streamed into size-bounded safetensors shards inside a temporary directory
next to the target, with an index and per-tensor checksums; the directory is renamed into place
only when complete, so a failed export never leaves a half-written checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from parallel.shards import Box, hf_tensor_shapes

CHECKSUMS_FILE = "megarl_checksums.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked; the message names the file/tensor and the fix."""


def tensor_checksum(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (dtype and shape included), stable across layouts."""
    data = tensor.detach().contiguous().cpu()
    digest = hashlib.sha256(f"{data.dtype}:{tuple(data.shape)}:".encode())
    if data.numel():
        digest.update(data.reshape(-1).view(torch.uint8).numpy())  # hashes the buffer, no copy
    return digest.hexdigest()


class HFCheckpoint:
    """A local HF checkpoint directory (config.json + *.safetensors), validated on open."""

    def __init__(self, path: str | os.PathLike, check_tensors: bool = True):
        from safetensors import safe_open

        self.path = Path(path)
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{config_path} does not exist; point to an HF checkpoint directory")
        self.config: dict[str, Any] = json.loads(config_path.read_text())
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {self.path}; only safetensors checkpoints are supported")
        self._handles: dict[Path, Any] = {}
        self._file_of: dict[str, Path] = {}
        self._shape_of: dict[str, tuple[int, ...]] = {}
        self._dtype_of: dict[str, str] = {}
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for name in handle.keys():
                        info = handle.get_slice(name)
                        self._file_of[name] = file
                        self._shape_of[name] = tuple(info.get_shape())
                        self._dtype_of[name] = info.get_dtype()
            except Exception as error:  # safetensors raises its own error types
                raise CheckpointError(
                    f"{file} is not a readable safetensors file ({error}); re-download or re-export it"
                ) from error
        if check_tensors:
            self.check_against_config()

    @property
    def names(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape_of[name]

    def check_against_config(self) -> None:
        """Every expected tensor present with the expected shape; no unexpected tensor."""
        expected = hf_tensor_shapes(self.config)
        missing = sorted(set(expected) - set(self._shape_of))
        extra = sorted(set(self._shape_of) - set(expected))
        # Tied models may still store lm_head (a copy of the embedding); tolerate exactly that.
        if self.config.get("tie_word_embeddings") and extra == ["lm_head.weight"]:
            extra = []
        problems = []
        if missing:
            problems.append(f"missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)} in all)")
        if extra:
            problems.append(f"unexpected tensors {extra[:5]}{' ...' if len(extra) > 5 else ''} ({len(extra)} in all)")
        for name, shape in expected.items():
            if name in self._shape_of and self._shape_of[name] != shape:
                problems.append(f"{name} has shape {list(self._shape_of[name])}, config.json implies {list(shape)}")
        if problems:
            raise CheckpointError(f"{self.path} does not match its config.json: " + "; ".join(problems))

    def read_box(self, name: str, box: Box, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The ``box`` region of tensor ``name``, read from disk without loading the rest."""
        from safetensors import safe_open

        if name not in self._file_of:
            raise CheckpointError(f"tensor {name} is not in {self.path}")
        file = self._file_of[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        tensor = self._handles[file].get_slice(name)[tuple(slice(a, b) for a, b in box)]
        return tensor.to(dtype) if dtype is not None else tensor

    def read(self, name: str) -> torch.Tensor:
        return self.read_box(name, tuple((0, n) for n in self._shape_of[name]))

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every tensor (small checkpoints: tests and tools)."""
        return {name: self.read(name) for name in self.names}


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory beside ``target``; rename it to ``target`` on success, delete
    it on failure. An existing ``target`` is refused (never overwritten half-way)."""
    target = Path(target)
    if target.exists():
        raise CheckpointError(f"{target} already exists; choose a new output directory or remove it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would make the renamed checkpoint private
    try:
        yield tmp
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_hf_checkpoint(
    target: str | os.PathLike,
    config: dict[str, Any],
    tensors: Iterable[tuple[str, torch.Tensor]],
    max_shard_bytes: int = 2 << 30,
) -> dict[str, str]:
    """Stream ``(name, tensor)`` pairs into an HF checkpoint at ``target`` (atomically).

    At most one shard (``max_shard_bytes``) is held in memory. Returns name -> checksum, which is
    also written to ``megarl_checksums.json`` inside the checkpoint.
    """
    from safetensors.torch import save_file

    checksums: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    with atomic_directory(target) as tmp:
        shard: dict[str, torch.Tensor] = {}
        shard_bytes, shard_files, total_bytes = 0, [], 0

        def flush():
            nonlocal shard, shard_bytes
            if shard:
                name = f"model-{len(shard_files) + 1:05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                shard_files.append(name)
                for key in shard:
                    weight_map[key] = name
                shard, shard_bytes = {}, 0

        for name, tensor in tensors:
            tensor = tensor.detach().contiguous().cpu()
            size = tensor.numel() * tensor.element_size()
            if shard and shard_bytes + size > max_shard_bytes:
                flush()
            shard[name] = tensor
            shard_bytes += size
            total_bytes += size
            checksums[name] = tensor_checksum(tensor)
        flush()
        if len(shard_files) == 1:
            os.rename(tmp / shard_files[0], tmp / "model.safetensors")
        else:
            index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        (tmp / CHECKSUMS_FILE).write_text(json.dumps(checksums, indent=1, sort_keys=True))
    return checksums
