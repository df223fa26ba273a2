"""What a checkpoint keeps of one Megatron rank beside the models: its optimizer step counts and
its RNG states (torch, python, numpy, megatron's model-parallel trackers), in
``<checkpoint>/rank_states/<pool>/rank<r>.pt``.

Step counts are global. RNG states are per rank: a rank resumed at the layout and world size they
were saved at restores them (the resume is then exact); at another layout (an elastic resume) it
re-seeds from (seed, optimizer steps, rank): deterministic, but not an uninterrupted run's streams.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from pathlib import Path

import numpy as np
import torch


def rank_state_file(directory: str, pool: str, rank: int) -> Path:
    return Path(directory) / "rank_states" / pool / f"rank{rank}.pt"


def save_rank_state(path: Path, layout, world_size: int, optimizer_steps: dict[str, int]) -> None:
    """This rank's step counts and RNG states at ``path`` (atomic)."""
    from megatron.core import tensor_parallel

    from parallel.checkpoint.atomic import atomic_file

    state = {
        "layout": dataclasses.asdict(layout), "world_size": world_size, "optimizer_steps": optimizer_steps,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": _numpy_rng_state(),
                "megatron": tensor_parallel.get_cuda_rng_tracker().get_states()},
    }
    with atomic_file(path) as temporary:
        torch.save(state, temporary)


def load_rank_state(directory: str, pool: str, rank: int) -> dict:
    """The state rank ``rank`` of ``pool`` saved, or rank 0's when fewer ranks saved it."""
    mine = rank_state_file(directory, pool, rank)
    saved = mine if mine.is_file() else rank_state_file(directory, pool, 0)
    if not saved.is_file():
        raise FileNotFoundError(f"{saved} is missing: checkpoint {directory} holds no rank states of pool "
                                f"{pool!r}; resume with the pools it was saved with, or start a new run "
                                "from its weights (convert the checkpoint to HF with `megarl convert`)")
    # weights_only: a checkpoint is data, never code (tensors, numbers, strings and containers)
    return torch.load(saved, weights_only=True)


def restore_rng(state: dict, layout, world_size: int, seed: int, rank: int) -> bool:
    """Restore the saved RNG states if ``layout`` and ``world_size`` are the saved ones, else
    re-seed from (seed, optimizer steps, rank); whether they were restored."""
    from megatron.core import tensor_parallel

    same_layout = state["layout"] == dataclasses.asdict(layout) and state["world_size"] == world_size
    if same_layout:
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        name, keys, *rest = state["rng"]["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng"]["megatron"])
    else:
        _reseed(seed, max(state["optimizer_steps"].values(), default=0), rank)
    return same_layout


def _numpy_rng_state() -> tuple:
    """numpy's global RNG state with its key array as a torch tensor, so that the rank state file
    loads with ``torch.load(weights_only=True)`` (which refuses numpy arrays)."""
    name, keys, *rest = np.random.get_state()
    return (name, torch.from_numpy(keys.astype(np.int64)), *rest)


def _reseed(seed: int, steps: int, rank: int) -> None:
    """Seed torch, python, numpy and megatron's model-parallel RNGs from (seed, steps, rank)."""
    from megatron.core import tensor_parallel

    derived = int.from_bytes(hashlib.sha256(f"{seed}/{steps}/{rank}".encode()).digest()[:4], "little") >> 1
    torch.manual_seed(derived)
    random.seed(derived)
    np.random.seed(derived)
    tensor_parallel.model_parallel_cuda_manual_seed(derived)
