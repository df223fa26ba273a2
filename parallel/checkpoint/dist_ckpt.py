"""Megatron distributed checkpoints of model weights: atomic save, load at any layout.

The checkpoint is megatron.core.dist_checkpointing's ``torch_dist`` format (global tensors,
layout-independent), plus ``megarl_checkpoint.json``: the HF config of the model, the layout it
was saved from, the layer spec it was written for (``layer_spec``, "local" when absent: both
specs' checkpoints hold the same keys and load into either), and per-HF-tensor checksums, so a
load can verify what it got and an export can recreate config.json. Saves go to a hidden
partial directory that is renamed when every rank has finished: a crash never leaves something
that looks like a checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping

import torch.distributed as dist

from parallel.checkpoint.atomic import atomic_directory, partial_dir
from parallel.checkpoint.errors import CheckpointError
from parallel.layout import MegatronLayout
from parallel.models import unwrap_model

METADATA_FILE = "megarl_checkpoint.json"
FORMAT_VERSION = 1


def _sharded_state_dict(chunks: list) -> dict:
    return {f"chunk{i}": unwrap_model(chunk).sharded_state_dict() for i, chunk in enumerate(chunks)}


def save_megatron_checkpoint(
    chunks: list, target: str | Path, hf_config: Mapping[str, Any], layout: MegatronLayout,
    checksums: Mapping[str, str] | None = None,
) -> Path:
    """Collective over all ranks: save the model chunks at ``target`` (refused if it exists)."""
    from megatron.core import dist_checkpointing

    from parallel.checkpoint.hf_io import chunks_layer_spec

    _write_results_in_this_process()
    return write_megatron_checkpoint(
        target, hf_config, layout, checksums,
        lambda directory: dist_checkpointing.save(_sharded_state_dict(chunks), str(directory)),
        layer_spec=chunks_layer_spec(chunks))


def _write_results_in_this_process() -> None:
    """Give megatron's checkpoint writer an in-process results queue. Its default is a queue
    served by a spawned Manager process, made for async saves (written by another process): the
    first save then waits ~4 s for that server to import torch, and the server outlives a SIGKILLed
    saver (Ray's way of stopping a worker). Our saves are synchronous: the writer puts its results
    and takes them back in the saving process, so a plain queue carries them."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()


def write_megatron_checkpoint(
    target: str | Path, hf_config: Mapping[str, Any], layout: MegatronLayout,
    checksums: Mapping[str, str] | None, write: Callable[[Path], None],
    check: Callable[[Path], None] | None = None, layer_spec: str = "local",
) -> Path:
    """Collective: ``write(directory)`` (every rank) the dist checkpoint into a hidden partial
    directory, add megarl's metadata (``layer_spec``: the spec whose model the files were written
    as), ``check(directory)`` (every rank; the complete checkpoint, loadable from the partial
    directory) and rename it to ``target`` when every rank is done. If ``write`` or ``check``
    raises, the partial directory is removed and nothing is published."""
    target = Path(target)
    if target.exists():
        raise CheckpointError(f"{target} already exists; choose a new output directory or remove it")
    first = dist.get_rank() == 0
    # rank 0 creates the partial directory (removing a killed save's) and renames it on success
    publish = atomic_directory(target, partial=partial_dir(target)) if first else contextlib.nullcontext()
    with publish:
        dist.barrier()
        partial = partial_dir(target)
        try:
            write(partial)
            dist.barrier()
            if first:
                metadata = {
                    "format_version": FORMAT_VERSION,
                    "hf_config": dict(hf_config),
                    "saved_layout": dataclasses.asdict(layout),
                    "layer_spec": layer_spec,
                    "checksums": dict(checksums or {}),
                }
                (partial / METADATA_FILE).write_text(json.dumps(metadata, indent=1, sort_keys=True))
            if check is not None:
                dist.barrier()  # the metadata is written
                check(partial)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)  # a failed save leaves nothing behind
            raise
    dist.barrier()
    return target


def read_checkpoint_metadata(path: str | Path) -> dict:
    """megarl's metadata of a checkpoint directory, with a clear error if it is not one."""
    path = Path(path)
    file = path / METADATA_FILE
    if not file.is_file():
        hint = " (an unfinished save? it was never renamed into place)" if partial_dir(path).exists() else ""
        raise CheckpointError(f"{path} is not a megarl Megatron checkpoint: {file} is missing{hint}")
    metadata = json.loads(file.read_text())
    if metadata.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{file}: format_version={metadata.get('format_version')}, this megarl reads {FORMAT_VERSION}")
    return metadata


def load_megatron_checkpoint(chunks: list, path: str | Path) -> dict:
    """Collective: load weights saved at any layout into this layout's chunks (in place).
    Returns the checkpoint's metadata."""
    from megatron.core import dist_checkpointing

    metadata = read_checkpoint_metadata(path)
    loaded = dist_checkpointing.load(_sharded_state_dict(chunks), str(path))
    for i, chunk in enumerate(chunks):
        missing, unexpected = unwrap_model(chunk).load_state_dict(loaded[f"chunk{i}"], strict=False)
        missing = [name for name in missing if not name.endswith("_extra_state")]
        if missing or unexpected:
            raise CheckpointError(f"{path}: chunk {i} missing {missing}, unexpected {unexpected}")
    return metadata


# Megatron's optimizer state in model space (every state tensor sharded like its parameter), so
# that it loads at another TP/PP/DP size. The distributed optimizer gathers its DP shards for that
# on DP rank 0 over gloo (host memory, not the GPU's); "fully_sharded_model_space", which would
# not gather, fails in megatron-core 0.16 (flattened ShardedTensors are no longer supported).
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable",
                      "distrib_optim_fully_reshardable_mem_efficient": True, "chained_optim_avoid_prefix": True}


def _optimizer_sharded_state_dict(chunks: list, optimizer, is_loading: bool) -> dict:
    return optimizer.sharded_state_dict(_sharded_state_dict(chunks), is_loading=is_loading,
                                        metadata=dict(OPTIMIZER_SHARDING))


def save_optimizer_checkpoint(optimizer, chunks: list, target: str | Path) -> None:
    """Collective: ``optimizer``'s state (Adam moments and step, fp32 main parameters of a bf16/fp16
    model) as a distributed checkpoint at ``target``, sharded like ``chunks``' parameters."""
    from megatron.core import dist_checkpointing

    _write_results_in_this_process()
    Path(target).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(_optimizer_sharded_state_dict(chunks, optimizer, is_loading=False), str(target))


def load_optimizer_checkpoint(optimizer, chunks: list, path: str | Path) -> None:
    """Collective: restore ``save_optimizer_checkpoint``'s state into ``optimizer`` over ``chunks``,
    whatever layout it was saved at."""
    from megatron.core import dist_checkpointing

    if not Path(path).is_dir():
        raise CheckpointError(f"{path}: no optimizer checkpoint there; resume from a checkpoint that has one "
                              "or start a new run from its weights")
    with _torch_adam_steps_in_state(optimizer):
        sharded = _optimizer_sharded_state_dict(chunks, optimizer, is_loading=True)
        optimizer.load_state_dict(dist_checkpointing.load(sharded, str(path)))


@contextlib.contextmanager
def _torch_adam_steps_in_state(optimizer):
    """Work around megatron-core 0.16's distributed optimizer over torch's Adam (no TE/apex, as on
    CPU), which keeps ``step`` in each parameter's state: the state dict it loads into reads that
    step (an empty state before the first step fails), and loading a "fully_reshardable" state
    copies every state key of a parameter though the loaded ones lack ``step`` (it is restored
    apart, from the param groups): a KeyError; and it gives every parameter the same step tensor,
    which torch's Adam then advances once per parameter. Here every parameter has a step before
    the load, keeps the one it was given, and gets its own copy after it."""
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    patched = [inner for inner in getattr(optimizer, "chained_optimizers", [optimizer])
               if isinstance(inner, DistributedOptimizer) and isinstance(inner.optimizer, torch.optim.Adam)]
    for inner in patched:
        inner.init_state_fn(inner.optimizer, inner.config)
        for state in inner.optimizer.state.values():
            state.setdefault("step", torch.tensor(0.0))

        def set_states(model_param, tensors, inner=inner, original=inner._set_main_param_and_optimizer_states):
            step = inner._get_main_param_and_optimizer_states(model_param)["step"]
            original(model_param, {"step": step, **tensors})

        inner._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        for inner in patched:
            del inner._set_main_param_and_optimizer_states
            for state in inner.optimizer.state.values():
                state["step"] = state["step"].clone()
