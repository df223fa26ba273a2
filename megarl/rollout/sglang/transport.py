"""How resharded tensors travel to an SGLang engine rank: flat buckets.

The resharding plan (run by :mod:`parallel.reshard.execute`) writes, per SGLang TP rank, that
rank's local parameters into views of flat byte buffers, one per bucket. A bucket travels as
its :class:`FlatLayout` (names, dtypes, shapes, byte offsets) and ONE handle of its buffer:

- a named shared-memory segment (CPU: :class:`SharedMemoryStaging`), a few hundred bytes;
- a CUDA IPC handle (GPU: :func:`flat_payload` exports it after a device synchronisation);
- or the buffer's bytes inline (:class:`FlatBucket` ``data``) where neither reaches the engine.

The payload SGLang's ``update_weights_from_tensor(load_format="direct")`` receives for a bucket is
one entry, ``(FLAT_PREFIX + layout, buffer)``; megarl's patch of SGLang's direct loader (installed
in the schedulers by :mod:`megarl.rollout.sglang.patches`) expands it into the parameters' views
with :func:`expand_flat_entries` and copies them into the parameters in place, then synchronises
the device, so the update's reply means the buffer may be reused. :func:`flat_views` is the one
function that carves a buffer into views, on the producer's side and on the engine's.

Knows tensors and bytes only (torch, SGLang's serializer for CUDA tensors), nothing of RL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pickle
from typing import Any, Mapping

FLAT_PREFIX = "megarl.flat:"  # the name of a payload entry that is a flat bucket; the layout follows
ALIGN = 64  # bytes; every tensor of a bucket starts at a multiple (any dtype's alignment)


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where each tensor of a flat bucket lives: ``entries`` of ``(name, dtype name, shape, byte
    offset)`` in order, and the bucket's size in bytes."""

    entries: tuple[tuple[str, str, tuple[int, ...], int], ...]
    nbytes: int

    @classmethod
    def of(cls, spec: Mapping[str, tuple]) -> "FlatLayout":
        """The layout of ``{name: (shape, dtype)}`` in order, each tensor ``ALIGN``-aligned."""
        entries, offset = [], 0
        for name, (shape, dtype) in spec.items():
            entries.append((name, str(dtype).removeprefix("torch."), tuple(shape), offset))
            offset += _aligned_nbytes(shape, dtype)
        return cls(tuple(entries), offset)

    @property
    def names(self) -> list[str]:
        return [name for name, *_ in self.entries]

    def encode(self) -> str:
        return json.dumps([self.nbytes, self.entries], separators=(",", ":"))

    @classmethod
    def decode(cls, text: str) -> "FlatLayout":
        nbytes, entries = json.loads(text)
        return cls(tuple((n, d, tuple(s), o) for n, d, s, o in entries), nbytes)


def bucket_layouts(spec: Mapping[str, tuple], bucket_bytes: int) -> list[FlatLayout]:
    """``{name: (shape, dtype)}`` split in order into layouts of at most ``bucket_bytes`` each (a
    larger tensor gets a bucket of its own)."""
    groups, current, size = [], {}, 0
    for name, (shape, dtype) in spec.items():
        nbytes = _aligned_nbytes(shape, dtype)
        if current and size + nbytes > bucket_bytes:
            groups.append(current)
            current, size = {}, 0
        current[name] = (shape, dtype)
        size += nbytes
    if current:
        groups.append(current)
    return [FlatLayout.of(group) for group in groups]


def _aligned_nbytes(shape, dtype) -> int:
    return -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN


def flat_views(flat, layout: FlatLayout) -> dict[str, Any]:
    """The tensors of a flat bucket: views of ``flat`` (a byte tensor of at least ``layout.nbytes``,
    on any device) as ``layout`` places them. The producer writes through them, the engine reads."""
    import torch

    views = {}
    for name, dtype, shape, offset in layout.entries:
        dtype = getattr(torch, dtype)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        views[name] = flat[offset: offset + nbytes].view(dtype).view(shape)
    return views


@dataclasses.dataclass
class FlatBucket:
    """One bucket of one SGLang rank as it travels: its layout and either ``payload`` (what SGLang
    decodes: the buffer named, :func:`flat_payload`) or ``data`` (the buffer's bytes, a numpy
    array, which Ray hands over without a copy; the engine handle stages it)."""

    layout: FlatLayout
    payload: bytes | None = None
    data: Any = None

    def inline_tensors(self) -> dict[str, Any]:
        """The tensors of a bucket whose bytes came inline: read-only views of ``data``."""
        import warnings

        import torch

        with warnings.catch_warnings():  # Ray's arrays are read-only; these tensors are only read
            warnings.simplefilter("ignore", UserWarning)
            return flat_views(torch.from_numpy(self.data), self.layout)


def flat_payload(flat, layout: FlatLayout) -> bytes:
    """The payload naming a flat bucket for SGLang's direct load: ``[(FLAT_PREFIX + layout, flat)]``
    with ``flat`` in shared memory (CPU: its segment's name) or on a GPU (ONE CUDA IPC handle,
    exported by SGLang's serializer after its reductions patch, which maps the device by UUID;
    the device is synchronised first, so the engine sees every byte the producer's kernels wrote).
    The producer must keep ``flat`` unchanged until the engine's update call returns."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing.reductions  # noqa: F401 - registers the tensor reducers

    items = [(FLAT_PREFIX + layout.encode(), flat[: layout.nbytes])]
    if flat.device.type == "cuda":
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
        torch.cuda.synchronize(flat.device)
    elif not flat.is_shared():
        raise ValueError("flat_payload: a CPU bucket must live in shared memory (SharedMemoryStaging)")
    out = io.BytesIO()
    with _file_system_sharing():
        ForkingPickler(out, pickle.HIGHEST_PROTOCOL).dump(items)
    return out.getvalue()


def expand_flat_entries(named_tensors) -> list[tuple[str, Any]]:
    """An SGLang rank's decoded ``(name, tensor)`` entries with every flat bucket
    (``FLAT_PREFIX`` entry) replaced by its tensors (:func:`flat_views`); other entries as they are."""
    out = []
    for name, tensor in named_tensors:
        if name.startswith(FLAT_PREFIX):
            out.extend(flat_views(tensor, FlatLayout.decode(name[len(FLAT_PREFIX):])).items())
        else:
            out.append((name, tensor))
    return out


def staged_tensors(payload: bytes) -> dict[str, Any]:
    """The tensors a shared-memory payload (:func:`flat_payload`, :meth:`SharedMemoryStaging.payload`)
    names, mapped in this local process."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions  # noqa: F401 - registers the tensor rebuilders

    return dict(expand_flat_entries(ForkingPickler.loads(payload)))


def serialize_rank_tensors(tensors: dict[str, Any]) -> bytes:
    """One TP rank's ``{name: CPU tensor}`` with the bytes inline, as SGLang's
    ``update_weights_from_tensor`` decodes it (with its whitelisting unpickler) in that rank's
    scheduler: plain pickle, each tensor first made to own exactly its bytes (a slice never drags
    its base's whole storage along). Self-contained: no shared memory or fd passing, which across
    the handle's process boundary would fail. For GPU tensors use :func:`flat_payload`."""
    items = _payload_items(tensors)
    if any(t.device.type != "cpu" for _, t in items):
        raise ValueError("serialize_rank_tensors sends CPU tensors inline; GPU buckets travel as one CUDA IPC "
                         "handle each (flat_payload)")
    own = [(n, t if t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone())
           for n, t in items]
    return pickle.dumps(own, protocol=pickle.HIGHEST_PROTOCOL)


class SharedMemoryStaging:
    """Per-rank flat CPU buffers in shared memory, reused by every weight update (of an engine on
    this host, or of a trainer rank's shards): a bucket's tensors are written into views of the
    buffer (:meth:`flats`) and the payload names the buffer (torch's ``file_system`` sharing: a
    few hundred bytes, rebuilt by SGLang's whitelisted ``rebuild_storage_filename``) instead of
    carrying the bytes, which saves three copies (the handle's pipe, SGLang's zmq hop, the
    unpickling) per update: 88 MB went from 0.6 s to 0.1 s here. The schedulers copy out of the
    buffer before the update call returns, so the next update may overwrite it. When /dev/shm
    cannot hold a buffer, :meth:`flats` and :meth:`payload` return None and the caller sends the
    bytes inline."""

    def __init__(self):
        self._buffers: dict[int, Any] = {}  # rank -> flat uint8 tensor in shared memory

    def flats(self, rank: int, layouts: list[FlatLayout]) -> list | None:
        """Rank ``rank``'s buffer carved into one byte tensor per layout (grown when too small; its
        contents are not kept then); None when /dev/shm cannot hold it."""
        import shutil

        import torch

        need = sum(layout.nbytes for layout in layouts)
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
        flats, offset = [], 0
        for layout in layouts:
            flats.append(buffer[offset: offset + layout.nbytes])
            offset += layout.nbytes
        return flats

    def payload(self, rank: int, tensors: dict[str, Any]) -> bytes | None:
        """``tensors`` (CPU) copied into rank ``rank``'s buffer, as the payload naming it (None: no room)."""
        items = _payload_items(tensors)
        if any(t.device.type != "cpu" for _, t in items):
            return None
        layout = FlatLayout.of({name: (t.shape, t.dtype) for name, t in items})
        flats = self.flats(rank, [layout])
        if flats is None:
            return None
        views = flat_views(flats[0], layout)
        for name, tensor in items:
            views[name].copy_(tensor)
        return flat_payload(flats[0], layout)

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


def _payload_items(tensors: dict[str, Any]) -> list:
    import torch

    items = []
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"update payload entries must be str -> torch.Tensor, got {name!r} -> "
                            f"{type(tensor).__name__}")
        items.append((name, tensor.detach()))
    return items
