"""Running a resharding plan (:mod:`parallel.reshard.plan`): its copies and zero fills, in place.

``execute_plan`` runs one device's part over torch.distributed: local slices copied, the rest
sent pair by pair in bounded buckets; ``execute_plan_in_memory`` runs a whole plan whose
tensors are all in this process (tests, planning tools). Both compile the plan's copies once
into merged strided runs (``_compile``), kept on the plan, so a trainer that executes the same
plan at every weight sync pays for the compilation once.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Mapping

import torch

from parallel.reshard.plan import Copy, Plan
from parallel.shards import Box, box_volume


@dataclasses.dataclass(frozen=True)
class _Run:
    """One or more copies (or zero fills) as a single strided view of each side's storage:
    ``size`` elements at ``src_stride`` from ``src_offset`` and ``dst_stride`` from ``dst_offset``
    (elements, relative to the tensor's own offset). A side that is a flat transfer bucket is
    contiguous; a zero fill has no source. With ``parts``, the run writes whole rows that are
    the parts' column blocks side by side (their sources; its own source fields are the first
    part's)."""

    src: int | None
    src_key: tuple[int, str] | None
    dst: int | None
    dst_key: str | None
    size: tuple[int, ...]
    src_stride: tuple[int, ...]
    src_offset: int
    dst_stride: tuple[int, ...]
    dst_offset: int
    parts: tuple[_Run, ...] = ()

    def view(self, tensor: torch.Tensor, side: str) -> torch.Tensor:
        stride, offset = (self.src_stride, self.src_offset) if side == "src" else (self.dst_stride, self.dst_offset)
        return tensor.as_strided(self.size, stride, tensor.storage_offset() + offset)


def _row_major(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _side(box: Box, shape) -> tuple[tuple[int, ...], int]:
    """Strides and element offset of ``box`` in a row-major tensor of ``shape``."""
    strides = _row_major(shape)
    return strides, sum(lo * s for (lo, _), s in zip(box, strides))


def _make_run(src, src_key, dst, dst_key, extents, src_side, dst_side) -> _Run:
    """A run over ``extents`` with size-1 dimensions dropped and dimensions that are contiguous
    on both sides merged, so a box of whole rows is one flat copy."""
    dims: list[tuple[int, int, int]] = []  # (extent, src stride, dst stride), outermost first
    inner = len(extents)  # a side with more dimensions has extent 1 in its leading ones (an expert's slot)
    for n, ss, ds in zip(extents, src_side[0][-inner:], dst_side[0][-inner:]):
        if n == 1:
            continue
        if dims and dims[-1][1] == n * ss and dims[-1][2] == n * ds:
            dims[-1] = (dims[-1][0] * n, ss, ds)
        else:
            dims.append((n, ss, ds))
    dims = dims or [(1, 1, 1)]
    return _Run(src, src_key, dst, dst_key, tuple(d[0] for d in dims), tuple(d[1] for d in dims), src_side[1],
                tuple(d[2] for d in dims), dst_side[1])


def _merge(a: _Run, b: _Run) -> _Run | None:
    """``a`` and then ``b`` as one run when both are contiguous on both sides and either adjoin
    (gate then up) or, at equal length, continue a constant step (a head group's rows), else None."""
    if (a.src, a.src_key, a.dst, a.dst_key) != (b.src, b.src_key, b.dst, b.dst_key) or len(b.size) != 1 \
            or b.src_stride != (1,) or b.dst_stride != (1,) or a.src_stride[-1] != 1 or a.dst_stride[-1] != 1:
        return None
    if len(a.size) == 1 and b.src_offset == a.src_offset + a.size[0] and b.dst_offset == a.dst_offset + a.size[0]:
        return dataclasses.replace(a, size=(a.size[0] + b.size[0],))
    if a.size[-1] != b.size[0] or b.src_offset <= a.src_offset or b.dst_offset <= a.dst_offset:
        return None
    if len(a.size) == 1:
        return dataclasses.replace(a, size=(2, a.size[0]), src_stride=(b.src_offset - a.src_offset, 1),
                                   dst_stride=(b.dst_offset - a.dst_offset, 1))
    n = a.size[0]
    if len(a.size) == 2 and b.src_offset == a.src_offset + n * a.src_stride[0] \
            and b.dst_offset == a.dst_offset + n * a.dst_stride[0]:
        return dataclasses.replace(a, size=(n + 1, a.size[1]))
    return None


def _side_by_side(runs: list[_Run]) -> list[_Run]:
    """Runs that write column blocks of whole rows of one tensor as one run with ``parts``: a
    ``torch.cat`` writes the rows one after the other, where each block's strided copy runs at
    about 0.6x a contiguous one."""
    blocks: dict = defaultdict(list)
    for run in runs:
        if len(run.size) == 2 and run.dst_stride[1] == 1 and run.src_stride[1] == 1:
            blocks[(run.dst, run.dst_key, run.size[0], run.dst_stride[0], run.dst_offset // run.dst_stride[0])].append(run)
    joined: dict[int, _Run | None] = {}  # id of a group's first run -> the group as one run, of the others -> None
    for (_, _, rows, row, _), group in blocks.items():
        group.sort(key=lambda r: r.dst_offset)
        if len(group) > 1 and sum(r.size[1] for r in group) == row and group[0].dst_offset % row == 0 and all(
                b.dst_offset == a.dst_offset + a.size[1] for a, b in zip(group, group[1:])):
            joined[id(group[0])] = dataclasses.replace(group[0], size=(rows, row), dst_stride=(row, 1),
                                                       parts=tuple(group))
            joined.update({id(r): None for r in group[1:]})
    return [joined.get(id(r), r) for r in runs if joined.get(id(r), r) is not None]


def _merged(runs) -> list[_Run]:
    out: list[_Run] = []
    for run in runs:
        merged = _merge(out[-1], run) if out else None
        if merged is None:
            out.append(run)
        else:
            out[-1] = merged
    return out


def _box_extents(box: Box) -> list[int]:
    return [b - a for a, b in box]


@dataclasses.dataclass
class _Compiled:
    """A plan's copies for one executor as merged runs (``_run_all``), the tensor shapes they
    assume, and (``reuse_views``) the last executed tensors' views."""

    fills: list[_Run]
    local: list[_Run]
    buckets: list[tuple[int, int, int, list[_Run]]]  # (src, dst, elements, runs) in transfer order
    shapes: dict[tuple[str, int, object], tuple[int, ...]]
    kept: tuple | None = None  # (the tensors' addresses, their local and fill views)

    def check(self, sources, destinations) -> tuple[int, ...]:
        """Refuse tensors whose shape or layout differs from the ones the runs were compiled for
        (``sources(device)`` and ``destinations(device)`` give a device's tensors); returns
        their addresses, which name the storages the views would be of."""
        addresses = []
        for (side, device, key), shape in self.shapes.items():
            tensor = (sources if side == "src" else destinations)(device)[key]
            if tuple(tensor.shape) != shape or not tensor.is_contiguous():
                raise ValueError(f"{side} tensor {key} on device {device}: shape {tuple(tensor.shape)} "
                                 f"(contiguous: {tensor.is_contiguous()}), the plan was compiled for {shape}")
            addresses.append(tensor.data_ptr())
        return tuple(addresses)

    def local_views(self, sources, destinations, reuse: bool) -> tuple:
        """The views of the local runs and fills (``_views``) over the checked tensors (as for
        ``check``). With ``reuse`` they are kept for the next execution over the same storages
        (which they keep alive): making a MoE plan's ~700 views took 4 ms of a 28 ms execution."""
        addresses = self.check(sources, destinations)
        if self.kept is not None and self.kept[0] == addresses:
            views = self.kept[1]
        else:
            views = _views(self.local, self.fills, lambda r: sources(r.src)[r.src_key],
                           lambda r: destinations(r.dst)[r.dst_key])
        self.kept = (addresses, views) if reuse else None
        return views


def _compile(plan: Plan, device: int | None, source_shapes, bucket_bytes: int) -> _Compiled:
    """Runs of every copy (``device`` None: all devices, in this process) or of ``device``'s part:
    its zero fills, its local copies, and per peer pair the buckets it packs or unpacks.
    ``source_shapes(device, key)`` is the shape of a source tensor held here."""
    shapes: dict[tuple[str, int, object], tuple[int, ...]] = {}

    def src_side(copy):
        shape = shapes.setdefault(("src", copy.src, copy.src_key), tuple(source_shapes(copy.src, copy.src_key)))
        return _side(copy.src_box, shape)

    def dst_side(dst, key, box):
        shape = shapes.setdefault(("dst", dst, key), tuple(plan.destinations[dst][key].shape))
        return _side(box, shape)

    fills = [_make_run(None, None, f.dst, f.dst_key, _box_extents(f.dst_box), dst_side(f.dst, f.dst_key, f.dst_box),
                       dst_side(f.dst, f.dst_key, f.dst_box))
             for f in plan.zero_fills if device in (None, f.dst)]
    local, pairs = [], defaultdict(list)
    for copy in plan.copies:
        if device is None or copy.src == copy.dst == device:
            local.append(_make_run(copy.src, copy.src_key, copy.dst, copy.dst_key, _box_extents(copy.src_box),
                                   src_side(copy), dst_side(copy.dst, copy.dst_key, copy.dst_box)))
        elif device in (copy.src, copy.dst):
            pairs[(copy.src, copy.dst)].append(copy)
    buckets = []
    for (src, dst), copies in sorted(pairs.items()):
        for bucket in _buckets(copies, bucket_bytes):
            runs, offset = [], 0
            for copy in bucket:
                extents = _box_extents(copy.src_box)
                flat = (_row_major(extents), offset)
                runs.append(_make_run(src, copy.src_key, None, None, extents, src_side(copy), flat) if device == src
                            else _make_run(None, None, dst, copy.dst_key, extents, flat,
                                           dst_side(dst, copy.dst_key, copy.dst_box)))
                offset += box_volume(copy.src_box)
            buckets.append((src, dst, offset, _side_by_side(_merged(runs))))
    return _Compiled(fills, _side_by_side(_merged(local)), buckets, shapes)


def _compiled(plan: Plan, device: int | None, sources, bucket_bytes: int = 0) -> _Compiled:
    """The plan's runs for this executor, compiled once and kept on the plan: the trainer builds
    its plans once and executes them at every weight sync."""
    key = (device, bucket_bytes)
    if key not in plan._compiled:
        plan._compiled[key] = _compile(plan, device, lambda d, k: sources(d)[k].shape, bucket_bytes)
    return plan._compiled[key]


def _views(runs: list[_Run], fills: list[_Run], source, target) -> tuple[list, list, list, list]:
    """The runs' views as ``_run_all`` takes them: the destination and source views of the runs
    that are one copy each, the (destination, sources) of those that are one ``torch.cat``, and
    the fills' destination views. ``target(run)`` and ``source(run)`` are the tensors a run views."""
    single = [run for run in runs if not run.parts]
    return ([run.view(target(run), "dst") for run in single], [run.view(source(run), "src") for run in single],
            [(run.view(target(run), "dst"), [p.view(source(p), "src") for p in run.parts]) for run in runs if run.parts],
            [run.view(target(run), "dst") for run in fills])


def _run_all(views: tuple[list, list, list, list]) -> None:
    """Zero the fills, then copy every run (``_views``' lists): the single copies in one
    ``torch._foreach_copy_`` call (no Python per copy; each copy spread over torch's intra-op
    threads, which on a CPU are still awake from the update before a sync: copy threads of
    our own competed with them for the cores, 0.65-0.76x of a plain copy against 0.83-0.93x),
    the column blocks written side by side each by one ``torch.cat``."""
    destinations, sources, joined, fills = views
    for view in fills:
        view.zero_()
    if destinations:
        torch._foreach_copy_(destinations, sources)
    for destination, parts in joined:
        torch.cat(parts, dim=1, out=destination)


def execute_plan_in_memory(plan: Plan, sources: Mapping[int, Mapping[tuple[int, str], torch.Tensor]],
                           destinations: Mapping[int, Mapping[str, torch.Tensor]], reuse_views: bool = False) -> None:
    """Run a plan when every device's tensors are in this process (tests, planning tools):
    writes the destination tensors (contiguous, as are the sources) in place; ``reuse_views`` as
    for ``execute_plan``."""
    compiled = _compiled(plan, None, sources.__getitem__)
    _run_all(compiled.local_views(sources.__getitem__, destinations.__getitem__, reuse_views))


def execute_plan(
    plan: Plan,
    device: int,
    sources: Mapping[tuple[int, str], torch.Tensor],
    destinations: Mapping[str, torch.Tensor],
    bucket_bytes: int = 64 << 20,
    group=None,
    reuse_views: bool = False,
) -> dict[str, int]:
    """This device's part of a plan, over torch.distributed (device index = rank in ``group``).

    Writes ``destinations`` (preallocated and contiguous, e.g. the buffers handed to SGLang) in
    place from local ``sources`` and from peers. Peer traffic goes pair by pair in one global
    (src, dst) order, so every process walks the same sequence and no send waits on a receive
    that comes later; each pair's copies travel in flat buckets of at most ``bucket_bytes``, two
    in flight at a time, so packing or unpacking one bucket overlaps the transfer of the next
    (the two buckets are the only extra memory). Returns bytes copied locally, sent and received.

    ``reuse_views``: the sources and destinations are the same storages at every call (model
    parameters, a persistent staging buffer), so the local copies' views are kept for the next
    call; they keep those storages alive, so leave it off for buffers made anew for each call.
    """
    import torch.distributed as dist

    compiled = _compiled(plan, device, lambda d: sources, bucket_bytes)
    _run_all(compiled.local_views(lambda d: sources, lambda d: destinations, reuse_views))
    source, target = (lambda r: sources[r.src_key]), (lambda r: destinations[r.dst_key])
    stats = {"local_bytes": sum(math.prod(r.size) for r in compiled.local) * plan.element_size,
             "sent_bytes": 0, "received_bytes": 0}
    capacity = max((numel for _, _, numel, _ in compiled.buckets), default=0)
    free: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)  # flat buffers, two per dtype at most
    in_flight: list[tuple] = []  # (work, buffer, bucket), oldest first

    def finish_oldest():
        work, buffer, (_, dst, numel, runs) = in_flight.pop(0)
        work.wait()
        if dst == device:
            flat = buffer[:numel]
            _run_all(_views(runs, [], lambda r: flat, target))
        free[buffer.dtype].append(buffer)

    for bucket in compiled.buckets:
        src, dst, numel, runs = bucket
        while in_flight and (len(in_flight) == 2 or in_flight[-1][2][:2] != (src, dst)):
            finish_oldest()  # two buckets in flight, and a pair's transfers end before the next pair's
        like = next(iter(destinations.values())) if device == dst else sources[runs[0].src_key]
        dtype = like.dtype  # on the tensors' device: NCCL moves GPU memory only
        buffer = free[dtype].pop() if free[dtype] else torch.empty(capacity, dtype=dtype, device=like.device)
        flat = buffer[:numel]
        if device == src:
            _run_all(_views(runs, [], source, lambda r: flat))
            work = dist.isend(flat, dst=src_to_group_rank(dst, group), group=group)
            stats["sent_bytes"] += flat.numel() * flat.element_size()
        else:
            work = dist.irecv(flat, src=src_to_group_rank(src, group), group=group)
            stats["received_bytes"] += flat.numel() * flat.element_size()
        in_flight.append((work, buffer, bucket))
    while in_flight:
        finish_oldest()
    return stats


def src_to_group_rank(device: int, group) -> int:
    """Global rank of ``device`` (devices are numbered by their rank in ``group``)."""
    import torch.distributed as dist

    return device if group is None else dist.get_global_rank(group, device)


def _buckets(copies: list[Copy], bucket_bytes: int):
    bucket, size = [], 0
    for copy in copies:
        if bucket and size + copy.nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(copy)
        size += copy.nbytes
    if bucket:
        yield bucket
