"""HF safetensors checkpoints: validated, sliced reads and atomic, streamed writes.

Reading: a checkpoint is checked against its config before any tensor is read (every tensor
the family expects is present with the right shape, nothing unexpected, headers readable; the
files are those ``model.safetensors.index.json`` names when there is one), then
tensors are read box by box straight from the files (safetensors slices), so a rank that needs a
shard never loads the whole tensor, let alone the model.

Writing: tensors are streamed into size-bounded safetensors shards inside a temporary directory
next to the target (each file's header is written from the expected shapes first, then every
tensor as it arrives, so one tensor is in memory at a time), with an index and per-tensor
checksums; the directory is renamed into place only when complete (and, with ``check``, verified
where it was written), so a failed export never leaves a half-written or unverified checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch

from parallel.checkpoint.atomic import atomic_directory
from parallel.checkpoint.errors import CheckpointError
from parallel.shards import Box, hf_tensor_shapes

CHECKSUMS_FILE = "megarl_checksums.json"

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


def check_chunk_names(chunk_index: int, actual: set[str], expected: set[str]) -> None:
    """A model chunk's parameter names must be exactly those the family's weight rules produce."""
    if actual != expected:
        raise CheckpointError(
            f"model chunk {chunk_index} parameters do not match the family's weight rules: "
            f"not produced by the rules {sorted(actual - expected)}, rules without a parameter "
            f"{sorted(expected - actual)}; the model was built with a different spec or family"
        )


def chunks_layer_spec(chunks: list) -> str:
    """The layer spec (``model_specs.LAYER_SPECS``) the chunks' parameter names are spelled in:
    a model says itself whether its norms are fused into linear_qkv / linear_fc1 (TE) or not."""
    from model_specs import layer_spec_of
    from parallel.models import unwrap_model

    return layer_spec_of(name for chunk in chunks for name, _ in unwrap_model(chunk).named_parameters())


def tensor_checksum(tensor: torch.Tensor, algorithm=hashlib.sha256) -> str:
    """Hex digest (``algorithm``: a hashlib-style constructor) of a tensor's dtype, shape and
    row-major bytes: stable across layouts; CUDA tensors are hashed from a host copy."""
    data = tensor.detach().contiguous().cpu()
    digest = algorithm(f"{data.dtype}:{tuple(data.shape)}:".encode())
    if data.numel():
        digest.update(memoryview(data.reshape(-1).view(torch.uint8).numpy()))  # hashes the buffer, no copy
    return digest.hexdigest()


INDEX_FILE = "model.safetensors.index.json"


class HFCheckpoint:
    """A local HF checkpoint directory (config.json + *.safetensors), validated on open.

    Which files hold the weights: with ``model.safetensors.index.json``, as HF transformers reads
    it, exactly the shards its weight_map names, each tensor from the file the index gives it
    (other ``*.safetensors`` beside them, e.g. shards of an older save, are not read; they are
    listed in ``unindexed_files``). Without an index, every ``*.safetensors`` file (HF transformers
    would read ``model.safetensors`` alone; the conversion's logit probe notices the difference),
    and a tensor in two of them is refused rather than settled by file order."""

    def __init__(self, path: str | os.PathLike, check_tensors: bool = True):
        self.path = Path(path)
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{config_path} does not exist; point to an HF checkpoint directory")
        self.config: dict[str, Any] = json.loads(config_path.read_text())
        self._file_of: dict[str, Path] = {}
        self._shape_of: dict[str, tuple[int, ...]] = {}
        self._dtype_of: dict[str, str] = {}
        self._start_of: dict[str, int] = {}  # byte offset of the tensor's data in its file
        present = sorted(self.path.glob("*.safetensors"))
        index_path = self.path / INDEX_FILE
        if index_path.is_file():
            weight_map = self._read_index(index_path)
            files = [self.path / name for name in sorted(set(weight_map.values()))]
            for file in files:
                if not file.is_file():
                    raise CheckpointError(
                        f"{index_path} names {file.name}, which is missing from {self.path}; the download or "
                        f"copy is incomplete: fetch every shard the index lists (or remove a stale index)")
            headers = {file: self._read_header(file) for file in files}
            for name, file_name in weight_map.items():
                file = self.path / file_name
                if name not in headers[file]:
                    raise CheckpointError(
                        f"{index_path} maps tensor {name} to {file_name}, which does not hold it: the index and "
                        f"the shards are from different saves; re-download or re-export the checkpoint")
                self._add(name, file, headers[file][name])
            self.unindexed_files = [file for file in present if file not in headers]
        else:
            if not present:
                raise CheckpointError(f"no *.safetensors files in {self.path}; only safetensors checkpoints are supported")
            for file in present:
                for name, entry in self._read_header(file).items():
                    if name in self._file_of:
                        raise CheckpointError(
                            f"tensor {name} is in both {self._file_of[name].name} and {file.name} in {self.path} "
                            f"(no {INDEX_FILE} says which to read): remove the stale file, or add the index "
                            f"the checkpoint was saved with")
                    self._add(name, file, entry)
            self.unindexed_files = []
        if check_tensors:
            self.check_against_config()

    def _read_index(self, index_path: Path) -> dict[str, str]:
        """The index's weight_map: tensor name -> shard file name (in this directory)."""
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"{index_path} is not a safetensors index ({error!r}); re-download it") from error
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) and Path(v).name == v for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: weight_map must map tensor names to file names in {self.path}")
        return weight_map

    @staticmethod
    def _read_header(file: Path) -> dict[str, tuple[tuple[int, ...], str, int]]:
        """name -> (shape, safetensors dtype, byte offset of the data) of every tensor in ``file``,
        validated by safetensors (header and sizes)."""
        from safetensors import safe_open

        try:
            with safe_open(str(file), framework="pt") as handle:
                info = {name: handle.get_slice(name) for name in handle.keys()}
                shapes = {name: (tuple(s.get_shape()), s.get_dtype()) for name, s in info.items()}
            with open(file, "rb") as raw:
                header_size = int.from_bytes(raw.read(8), "little")
                header = json.loads(raw.read(header_size))
            return {name: (*shapes[name], 8 + header_size + header[name]["data_offsets"][0]) for name in shapes}
        except Exception as error:  # safetensors raises its own error types
            raise CheckpointError(
                f"{file} is not a readable safetensors file ({error}); re-download or re-export it"
            ) from error

    def _add(self, name: str, file: Path, entry: tuple[tuple[int, ...], str, int]) -> None:
        self._file_of[name] = file
        self._shape_of[name], self._dtype_of[name], self._start_of[name] = entry

    @property
    def names(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape_of[name]

    def check_against_config(self) -> None:
        """Every expected tensor present with the expected shape; no unexpected tensor. A
        sequence-classification checkpoint (a reward model) has a score head instead of lm_head."""
        from model_specs import CLASSIFIER_HEAD, classifier_labels

        expected = hf_tensor_shapes(self.config)
        labels = classifier_labels(self.config)
        if labels is not None:
            expected.pop("lm_head.weight", None)
            expected[CLASSIFIER_HEAD] = (labels, self.config["hidden_size"])
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
        """The ``box`` region of tensor ``name``, read from disk without loading the rest.

        Plain reads of the box's rows (not safetensors' memory map, whose touched pages would
        stay in this process's resident set and grow it to the checkpoint's size)."""
        if name not in self._file_of:
            raise CheckpointError(f"tensor {name} is not in {self.path}")
        shape, element = self._shape_of[name], _TORCH_DTYPES[self._dtype_of[name]]
        rows = box[0] if shape else (0, 1)
        row_bytes = math.prod(shape[1:]) * element.itemsize
        length = (rows[1] - rows[0]) * row_bytes
        data = bytearray(length)
        if length:
            with open(self._file_of[name], "rb", buffering=0) as handle:
                handle.seek(self._start_of[name] + rows[0] * row_bytes)
                if handle.readinto(data) != length:
                    raise CheckpointError(f"{self._file_of[name]} ends inside tensor {name}; re-download or re-export it")
        tensor = torch.frombuffer(data, dtype=element) if length else torch.empty(0, dtype=element)
        tensor = tensor.reshape(rows[1] - rows[0], *shape[1:]) if shape else tensor.reshape(())
        if shape and any((a, b) != (0, n) for (a, b), n in zip(box[1:], shape[1:])):
            tensor = tensor[(slice(None), *(slice(a, b) for a, b in box[1:]))].clone()
        return tensor.to(dtype) if dtype is not None else tensor

    def read(self, name: str) -> torch.Tensor:
        return self.read_box(name, tuple((0, n) for n in self._shape_of[name]))

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every tensor (small checkpoints: tests and tools)."""
        return {name: self.read(name) for name in self.names}


def _safetensors_header(entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> bytes:
    """The header of a safetensors file holding ``entries`` back to back, in that order (the
    format: little-endian u64 header size, JSON header padded with spaces to 8 bytes, data)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_hf_checkpoint(
    target: str | os.PathLike,
    config: dict[str, Any],
    tensors: Iterable[tuple[str, torch.Tensor]],
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    max_shard_bytes: int = 2 << 30,
    partial: str | os.PathLike | None = None,
    check: Callable[[Path], None] | None = None,
) -> dict[str, str]:
    """Stream ``(name, tensor)`` pairs into an HF checkpoint at ``target`` (atomically).

    ``specs`` (name -> (shape, dtype), in the order the stream yields them) fixes every
    safetensors header before any data arrives, so each tensor goes to disk as it comes: at most
    one tensor is held, whatever ``max_shard_bytes`` is. A tensor out of order or with another
    shape or dtype fails the write. Returns name -> checksum, which is also written to
    ``megarl_checksums.json`` inside the checkpoint.

    ``partial``: the fixed name of the temporary directory beside ``target`` (``atomic_directory``);
    ``check(directory)``: called on the complete checkpoint in the temporary directory, before the
    rename; if it raises, nothing is published.
    """
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    shard_bytes = 0
    for name, (shape, dtype) in specs.items():
        size = math.prod(shape) * dtype.itemsize
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, tuple(shape), dtype))
        shard_bytes += size
    files = (["model.safetensors"] if len(shards) == 1
             else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    expected = iter([(file, entry) for file, shard in zip(files, shards) for entry in shard])
    checksums: dict[str, str] = {}
    with atomic_directory(target, partial=partial) as tmp:
        handle, current = None, None
        try:
            for name, tensor in tensors:
                file, (want_name, shape, dtype) = next(expected, (None, (None, None, None)))
                tensor = tensor.detach().contiguous().cpu()
                if name != want_name or tuple(tensor.shape) != shape or tensor.dtype != dtype:
                    raise CheckpointError(f"export stream gave {name} {list(tensor.shape)} {tensor.dtype}, expected "
                                          f"{want_name} {list(shape or ())} {dtype} next")
                if file != current:
                    if handle is not None:
                        handle.close()
                    handle, current = open(tmp / file, "wb"), file
                    handle.write(_safetensors_header(shards[files.index(file)]))
                if tensor.numel():
                    handle.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
                checksums[name] = tensor_checksum(tensor)
        finally:
            if handle is not None:
                handle.close()
        missing = [name for name in specs if name not in checksums]
        if missing:
            raise CheckpointError(f"export stream ended before {missing[:5]} ({len(missing)} tensors)")
        if len(files) > 1:
            weight_map = {name: file for file, shard in zip(files, shards) for name, _, _ in shard}
            total = sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        (tmp / CHECKSUMS_FILE).write_text(json.dumps(checksums, indent=1, sort_keys=True))
        if check is not None:
            check(tmp)
    return checksums
