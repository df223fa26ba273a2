"""Resharding plans: which slice of which source rank's tensor goes into which destination buffer.

Both layouts are described as boxes of the canonical HF tensors (``parallel.shards``), so a plan
is box intersection: for every destination piece, the source pieces that hold the same HF
region. Replicas (TP-replicated norms, data-parallel copies) hold identical boxes; the planner
takes each region once, from a holder on the destination's own device when there is one (no
network), else from the least-loaded holder. ``Plan.check()`` proves, before anything moves,
that every destination element is written exactly once with matching extents, and the plan
reports the bytes it sends over the network next to the theoretical minimum (bytes a
destination needs that its co-located source rank does not hold). Running a plan is
:mod:`parallel.reshard.execute`.

Devices: the trainer's global rank g runs on device g. Colocated (hybrid engine), SGLang rank r
of engine e runs on device ``e * rollout_tp + r``. Engines on a pool of their own get their shards
assembled on trainer devices (``separate_pool_rounds``) and shipped from there.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Mapping

from parallel.layout import MegatronLayout
from parallel.shards import (
    Box,
    LocalTensor,
    MegatronRank,
    box_intersection,
    box_volume,
    extents_match,
    megatron_position,
    megatron_shards,
    sglang_shards,
)


@dataclasses.dataclass(frozen=True)
class Copy:
    """Copy ``src_box`` of source tensor ``src_key`` on device ``src`` into ``dst_box`` of
    destination tensor ``dst_key`` on device ``dst``."""

    src: int
    src_key: tuple[int, str]  # (model chunk, megatron parameter name)
    src_box: Box
    dst: int
    dst_key: str
    dst_box: Box
    nbytes: int


@dataclasses.dataclass(frozen=True)
class ZeroFill:
    dst: int
    dst_key: str
    dst_box: Box


@dataclasses.dataclass
class Plan:
    """A checked list of copies and zero fills, with what it costs on the network."""

    copies: list[Copy]
    zero_fills: list[ZeroFill]
    destinations: dict[int, dict[str, LocalTensor]]  # device -> its destination tensors
    element_size: int
    minimum_network_bytes: int
    # parallel.reshard.execute's runs of this plan, compiled at its first execution on each device
    _compiled: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict:
        """Pickled (e.g. shipped to the workers through Ray) without its compiled runs."""
        return {k: v for k, v in self.__dict__.items() if k != "_compiled"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _compiled={})

    @property
    def network_bytes(self) -> int:
        return sum(c.nbytes for c in self.copies if c.src != c.dst)

    @property
    def local_bytes(self) -> int:
        return sum(c.nbytes for c in self.copies if c.src == c.dst)

    def check(self) -> None:
        """Every destination element written exactly once, in bounds, extents equal."""
        boxes_of: dict[tuple[int, str], list[Box]] = defaultdict(list)  # grouped once, not per tensor
        for copy in self.copies:
            if not extents_match(copy.src_box, copy.dst_box):
                raise ValueError(f"copy {copy} has different source and destination extents")
            boxes_of[(copy.dst, copy.dst_key)].append(copy.dst_box)
        for fill in self.zero_fills:
            boxes_of[(fill.dst, fill.dst_key)].append(fill.dst_box)
        for device, tensors in self.destinations.items():
            for name, tensor in tensors.items():
                boxes = boxes_of[(device, name)]
                written = sum(box_volume(box) for box in boxes)
                if written != math.prod(tensor.shape):
                    raise ValueError(f"device {device} {name}: {written} of "
                                     f"{math.prod(tensor.shape)} elements written")
                for i, a in enumerate(boxes):
                    if any(not 0 <= lo < hi <= n for (lo, hi), n in zip(a, tensor.shape)):
                        raise ValueError(f"device {device} {name}: box {a} outside {tensor.shape}")
                    for b in boxes[i + 1:]:
                        if box_intersection(a, b) is not None:
                            raise ValueError(f"device {device} {name}: boxes {a} and {b} both written")

    def summary(self) -> str:
        return (f"{len(self.copies)} copies, {self.local_bytes / 2**20:.1f} MiB local, "
                f"{self.network_bytes / 2**20:.1f} MiB over the network (minimum "
                f"{self.minimum_network_bytes / 2**20:.1f} MiB)")


def _translate(region: Box, piece_src: Box, piece_dst: Box) -> Box:
    """``region`` (HF coordinates, inside ``piece_src``) in the local tensor's coordinates (a
    destination's extra leading dimensions, an expert's slot, kept as they are)."""
    lead = len(piece_dst) - len(piece_src)
    return piece_dst[:lead] + tuple((d0 + r0 - s0, d0 + r1 - s0)
                                    for (r0, r1), (s0, _), (d0, _) in zip(region, piece_src, piece_dst[lead:]))


def megatron_device_positions(layout: MegatronLayout, world_size: int) -> dict[int, MegatronRank]:
    """Global rank -> model position (``parallel.shards.megatron_position``) of every rank."""
    layout.data_parallel_size(world_size)  # refuses a world the layout does not divide
    return {rank: megatron_position(rank, layout, world_size) for rank in range(world_size)}


def colocated_engine_ranks(world_size: int, rollout_tp: int) -> dict[int, int]:
    """Device -> SGLang rank for the hybrid engine: one engine per ``rollout_tp`` trainer devices."""
    return {e * rollout_tp + r: r for e in range(max(1, world_size // rollout_tp)) for r in range(rollout_tp)}


def separate_pool_rounds(world_size: int, rollout_tp: int) -> list[dict[int, int]]:
    """Device -> SGLang rank assembled there, per round, for engines outside the trainer's pool.

    Every engine's rank r needs the same tensors, so each of the ``rollout_tp`` distinct shard
    sets is assembled once, on trainer device ``r % world_size``, and sent to every engine; when
    the engines have more ranks than the trainer has devices, that takes several rounds."""
    return [{r - start: r for r in range(start, min(start + world_size, rollout_tp))}
            for start in range(0, rollout_tp, world_size)]


def plan_megatron_to_sglang(
    hf: Mapping[str, object], layout: MegatronLayout, world_size: int, rollout_tp: int,
    engine_ranks: Mapping[int, int] | None = None, element_size: int = 4, layer_spec: str = "local",
    rollout_ep: int = 1,
) -> Plan:
    """Plan the weight sync from a Megatron actor (``layout`` over ``world_size`` devices) into
    SGLang shards of tensor parallelism ``rollout_tp`` (an MoE model's experts under expert
    parallelism ``rollout_ep`` inside it): ``engine_ranks`` maps each destination
    device to the SGLang rank whose shards it receives (default: ``colocated_engine_ranks``).
    The copies' source keys are the actor's parameter names as its ``layer_spec`` names them."""
    source = megatron_shards(hf, layout, layer_spec=layer_spec)
    holders: dict[str, list] = defaultdict(list)  # hf name -> [(device, key, piece)]
    for device, position in megatron_device_positions(layout, world_size).items():
        for chunk_index, tensors in enumerate(source[position]):
            for name, tensor in tensors.items():
                for piece in tensor.pieces:
                    if piece.hf is not None:
                        holders[piece.hf].append((device, (chunk_index, name), piece))
    per_rank = sglang_shards(hf, rollout_tp, rollout_ep)
    if engine_ranks is None:
        engine_ranks = colocated_engine_ranks(world_size, rollout_tp)
    destinations = {device: per_rank[rank] for device, rank in engine_ranks.items()}
    copies, fills, minimum = [], [], 0
    sent_by: dict[int, int] = defaultdict(int)
    for device, tensors in destinations.items():
        for name, tensor in tensors.items():
            for piece in tensor.pieces:
                if piece.hf is None:
                    fills.append(ZeroFill(device, name, piece.dst))
                    continue
                regions: dict[Box, list] = defaultdict(list)  # identical boxes = replicas
                for holder, key, src_piece in holders[piece.hf]:
                    region = box_intersection(piece.src, src_piece.src)
                    if region is not None:
                        regions[region].append((holder, key, src_piece))
                boxes = list(regions)
                covered = sum(box_volume(b) for b in boxes)
                if covered != box_volume(piece.src) or any(
                    box_intersection(a, b) is not None for i, a in enumerate(boxes) for b in boxes[i + 1:]
                ):
                    raise ValueError(f"{piece.hf} {piece.src}: the source layout does not tile this region "
                                     f"exactly once ({covered} of {box_volume(piece.src)} elements)")
                for region, candidates in regions.items():
                    nbytes = box_volume(region) * element_size
                    local = [c for c in candidates if c[0] == device]
                    if not local:
                        minimum += nbytes
                    holder, key, src_piece = local[0] if local else min(candidates, key=lambda c: (sent_by[c[0]], c[0]))
                    if holder != device:
                        sent_by[holder] += nbytes
                    copies.append(Copy(holder, key, _translate(region, src_piece.src, src_piece.dst), device, name,
                                       _translate(region, piece.src, piece.dst), nbytes))
    return Plan(copies, fills, destinations, element_size, minimum)
