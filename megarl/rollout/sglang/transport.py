"""How resharded tensors travel to an SGLang engine rank.

The resharding plan (run by :mod:`parallel.reshard.execute`) leaves, per SGLang TP rank, a ``{name: tensor}``
of that rank's local parameters; an engine rank lives in another process (SGLang's scheduler), so
the tensors have to be handed over as bytes. Two ways, both payloads that SGLang's
``update_weights_from_tensor`` decodes in the rank's scheduler:

- inline (:func:`serialize_rank_tensors`): the tensors' bytes in the payload; works everywhere;
- named (:class:`SharedMemoryStaging`): the tensors sit in a shared-memory buffer on the engine's
  host and the payload only names it (a few KB), which saves the copies of the bytes through every
  process hop; :func:`staged_tensors` maps such a payload back into tensors in a local process.

Here, not in the engine handle, because both sides use it: the engine handle encodes what it is
given, and a trainer process on the engine's host writes its shards straight into a staging buffer.
Knows tensors and bytes only (torch, SGLang's serializer for CUDA tensors), nothing of RL.
"""

from __future__ import annotations

import contextlib
import pickle
from typing import Any


def serialize_rank_tensors(tensors: dict[str, Any]) -> bytes:
    """One TP rank's ``{name: tensor}`` as the payload SGLang's ``update_weights_from_tensor``
    decodes (with its whitelisting unpickler) in that rank's scheduler.

    CPU tensors are pickled with their data inline (plain pickle; each tensor is first made to own
    exactly its bytes, so a slice never drags its base tensor's whole storage along): the payload
    is self-contained and needs no shared memory or fd passing, which across the handle's process
    boundary would fail (multiprocessing's fd sharer authenticates with a per-process-tree key).
    SGLang's ``monkey_patch_torch_reductions`` is NOT applied: after it, CPU tensors no longer
    serialize with multiprocessing's pickler (plain pickle is unaffected). CUDA tensors go as CUDA
    IPC handles, the way SGLang's own Engine serializes them (its serializer, after its reductions
    patch); that path needs a GPU and has not been run yet.
    """
    items = _payload_items(tensors)
    devices = {t.device.type for _, t in items}
    if devices <= {"cpu"}:
        own = [(n, t if t.is_contiguous() and t.storage_offset() == 0
                and t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone())
               for n, t in items]
        return pickle.dumps(own, protocol=pickle.HIGHEST_PROTOCOL)
    if devices == {"cuda"}:
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
        return MultiprocessingSerializer.serialize(items)
    raise ValueError(f"update payload mixes or uses unsupported devices {sorted(devices)}")


class SharedMemoryStaging:
    """Per-TP-rank CPU staging buffers in shared memory, reused by every weight update of an engine
    on this host (the handle's engine always is). A rank's tensors are copied into its buffer and
    the payload names the buffer (torch's ``file_system`` sharing: a few KB, rebuilt by SGLang's
    whitelisted ``rebuild_storage_filename``) instead of carrying the bytes, which saves three
    copies (the handle's pipe, SGLang's zmq hop, the unpickling) per update: 88 MB went from
    0.6 s to 0.1 s here. The schedulers copy out of the buffer before the update call returns,
    so the next update may overwrite it. When /dev/shm cannot hold a buffer, ``payload`` returns
    None and the caller sends the bytes inline (:func:`serialize_rank_tensors`).

    A trainer process on the engine's host can write its shards straight into such a buffer
    (:meth:`views`, then :meth:`named`): tensors already in shared memory are named as they are,
    never copied again."""

    ALIGN = 64  # bytes; every tensor starts at a multiple (any dtype's alignment)

    def __init__(self):
        self._buffers: dict[int, Any] = {}  # rank -> flat uint8 tensor in shared memory

    @classmethod
    def _aligned(cls, nbytes: int) -> int:
        return -(-nbytes // cls.ALIGN) * cls.ALIGN

    def views(self, rank: int, layout: dict[str, tuple]) -> dict[str, Any] | None:
        """Rank ``rank``'s buffer carved into one tensor per ``name: (shape, dtype)`` (grown when
        too small; its contents are not kept then); None when /dev/shm cannot hold it."""
        import shutil

        import torch

        sizes = {name: torch.Size(shape).numel() * dtype.itemsize for name, (shape, dtype) in layout.items()}
        need = sum(self._aligned(n) for n in sizes.values())
        buffer = self._buffers.get(rank)
        if buffer is None or buffer.numel() < need:
            self._buffers.pop(rank, None)
            try:
                free = shutil.disk_usage("/dev/shm").free
            except OSError:
                return None
            if free < need * 1.25:
                return None
            with _file_system_sharing():  # a named segment any local process can map
                buffer = self._buffers[rank] = torch.empty(need, dtype=torch.uint8).share_memory_()
        views, offset = {}, 0
        for name, (shape, dtype) in layout.items():
            views[name] = buffer[offset: offset + sizes[name]].view(dtype).view(shape)
            offset += self._aligned(sizes[name])
        return views

    @staticmethod
    def named(tensors: dict[str, Any]) -> bytes:
        """The payload of tensors that live in shared memory: their names and buffers, no bytes."""
        import io
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing.reductions  # noqa: F401 - registers the tensor reducers

        out = io.BytesIO()
        with _file_system_sharing():
            ForkingPickler(out, pickle.HIGHEST_PROTOCOL).dump(_payload_items(tensors))
        return out.getvalue()

    def payload(self, rank: int, tensors: dict[str, Any]) -> bytes | None:
        items = _payload_items(tensors)
        if any(t.device.type != "cpu" for _, t in items):
            return None
        if items and all(t.is_shared() for _, t in items):  # e.g. a trainer's staged shards
            return self.named(dict(items))
        views = self.views(rank, {name: (t.shape, t.dtype) for name, t in items})
        if views is None:
            return None
        for name, tensor in items:
            views[name].copy_(tensor)
        return self.named(views)

    def close(self) -> None:
        self._buffers.clear()


@contextlib.contextmanager
def _file_system_sharing():
    """torch's ``file_system`` sharing strategy for the block: tensors shared or pickled in it are
    named segments that any local process maps by name (the default, file descriptors, needs
    the receiver to be a child of the sender's multiprocessing tree)."""
    import torch.multiprocessing as torch_mp

    previous = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch_mp.set_sharing_strategy(previous)


def staged_tensors(payload: bytes) -> dict[str, Any]:
    """The tensors a :meth:`SharedMemoryStaging.named` payload names, mapped in this process."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions  # noqa: F401 - registers the tensor rebuilders

    return dict(ForkingPickler.loads(payload))


def _payload_items(tensors: dict[str, Any]) -> list:
    import torch

    items = []
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"update payload entries must be str -> torch.Tensor, got {name!r} -> "
                            f"{type(tensor).__name__}")
        items.append((name, tensor.detach()))
    return items
