"""One-entry caches for index tensors that every layer of a forward pass rebuilds from the same inputs."""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def reuse_while_unchanged(build: Callable[..., T]) -> Callable[..., T]:
    """``build`` that returns its last result again when called with the same arguments: tensors
    the same objects not modified in place since (``Tensor._version``), other arguments equal.
    The arguments of the last call are held, so their identities stay valid. For per-step index
    tensors that every layer derives from inputs megatron or SGLang pass through unchanged:
    building them once per step instead of per layer (and, on GPUs, without a device sync each)."""
    last: dict[str, tuple] = {}

    def fingerprint(arg):
        return ("tensor", id(arg), arg._version) if isinstance(arg, torch.Tensor) else ("value", arg)

    @functools.wraps(build)
    def reused(*args):
        key = tuple(map(fingerprint, args))
        entry = last.get("entry")
        if entry is None or entry[0] != key:
            entry = last["entry"] = (key, args, build(*args))
        return entry[2]

    return reused
