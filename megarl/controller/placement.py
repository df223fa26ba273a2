"""Where Megatron ranks and colocated SGLang engines run: pure functions of what Ray reports.

Ray reserves one bundle ({"GPU": 1, "CPU": 1}) per Megatron rank and reports, for bundle i, its
node and its GPU; the bundles come back in no particular (node, GPU) order. ``bundle_order`` puts
Megatron rank r in the r-th bundle in (node, GPU) order, so that consecutive ranks (a tensor-
parallel group) share a node and sit on consecutive GPUs. An engine of ``rollout.tp`` ranks runs
beside ``rollout.tp`` of those ranks: the ranks sorted by (node, GPU) are cut into consecutive
groups of ``rollout.tp``, so an engine never straddles two nodes and its GPUs are consecutive
local GPU ids of one node.

Each engine's processes see the GPUs of the actor's pool on its node (``CUDA_VISIBLE_DEVICES``,
in Ray's numbering, which is the numbering ``CUDA_VISIBLE_DEVICES`` takes) and start at
``base_gpu_id`` among them (SGLang: ``gpu_id = base_gpu_id + tp_rank * gpu_id_step``, a device
index within the visible ones). Without it every engine of a node would use GPUs 0..tp-1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class EnginePlacement:
    """One colocated engine: ``node`` (Ray's node id), ``ranks`` (the pool's ranks, = bundles, whose
    GPUs it uses, in tp-rank order), ``gpu_ids`` (their GPUs as Ray reported them: consecutive),
    ``node_gpu_ids`` (every GPU of the pool on that node, sorted: what the engine's processes see)
    and ``base_gpu_id`` (the index of ``gpu_ids[0]`` among ``node_gpu_ids``: SGLang's
    ``base_gpu_id``)."""

    node: str
    ranks: tuple[int, ...]
    gpu_ids: tuple[int, ...]
    node_gpu_ids: tuple[int, ...]
    base_gpu_id: int

    @property
    def visible_devices(self) -> str:
        """The engine's ``CUDA_VISIBLE_DEVICES``."""
        return ",".join(str(g) for g in self.node_gpu_ids)


def bundle_order(reports: Sequence[tuple[str, Sequence[int]]]) -> list[int]:
    """The bundle each Megatron rank runs in: rank r in bundle ``order[r]``, bundles sorted by
    (node, GPU ids). ``reports[i]`` is (node, GPU ids) of bundle i as Ray reports them (no GPU
    ids on CPU: bundles then keep their order within a node). IPv4 addresses sort numerically."""

    return sorted(range(len(reports)), key=lambda i: (_node_key(reports[i][0]), tuple(reports[i][1])))


def _node_key(node: str) -> tuple:
    """Nodes in order: "IP [id]" by IPv4 address numerically (10.0.0.9 before 10.0.0.10), then
    id (two Ray nodes on one host); other names after."""
    address, _, rest = node.partition(" ")
    parts = address.split(".")
    return (0, *map(int, parts), rest) if len(parts) == 4 and all(p.isdigit() for p in parts) else (1, node)


class PlacementError(ValueError):
    """The actor's GPUs cannot hold engines of ``rollout.tp`` ranks each; says which GPUs and the fix."""


def colocated_engine_placements(rank_gpus: Sequence[tuple[str, int]], tp: int) -> list[EnginePlacement]:
    """For each colocated engine, in order, where it runs: ``rank_gpus[i]`` is (node id, local GPU
    id) of the pool's rank i (in bundle i) as Ray reported it; ``tp`` is ``rollout.tp``. The ranks
    sorted by (node, GPU) are cut into groups of ``tp``, one per engine. ``PlacementError`` when a
    node's GPUs are not a multiple of ``tp`` (an engine would straddle nodes) or an engine's GPUs
    are not consecutive local ids."""
    if tp < 1:
        raise PlacementError(f"rollout.tp={tp}: must be >= 1")
    if not rank_gpus:
        raise PlacementError("no actor ranks to place colocated engines beside")
    for rank, (node, gpu) in enumerate(rank_gpus):
        if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
            raise PlacementError(f"rank {rank} on node {node}: Ray reported GPU id {gpu!r}, not a local GPU index "
                                 "(are CUDA_VISIBLE_DEVICES set to GPU UUIDs for Ray?); set integer ids")
    order = sorted(range(len(rank_gpus)), key=lambda rank: (_node_key(rank_gpus[rank][0]), rank_gpus[rank][1]))
    by_node: dict[str, list[int]] = {}
    for rank in order:
        by_node.setdefault(rank_gpus[rank][0], []).append(rank)
    placements = []
    for node, ranks in by_node.items():
        gpus = [rank_gpus[rank][1] for rank in ranks]
        twice = sorted({g for g in gpus if gpus.count(g) > 1})
        if twice:
            raise PlacementError(f"node {node}: GPU(s) {twice} reported for more than one rank of the actor's pool "
                                 f"(ranks {ranks}, GPUs {gpus}); each rank needs a GPU of its own")
        if len(ranks) % tp:
            raise PlacementError(f"rollout.tp={tp} does not divide the {len(ranks)} GPU(s) {gpus} of node {node} that "
                                 "the actor's pool holds: a colocated engine would straddle nodes; use a rollout.tp "
                                 f"that divides {len(ranks)}, or a pool of whole nodes")
        for start in range(0, len(ranks), tp):
            engine_gpus = gpus[start:start + tp]
            if engine_gpus != list(range(engine_gpus[0], engine_gpus[0] + tp)):
                raise PlacementError(f"rollout.tp={tp}: engine {len(placements)} would run on GPUs {engine_gpus} of node "
                                     f"{node} (the pool's GPUs there: {gpus}), not {tp} consecutive local GPU ids; "
                                     "give the actor's pool whole nodes, or use rollout.tp=1")
            placements.append(EnginePlacement(node, tuple(ranks[start:start + tp]), tuple(engine_gpus), tuple(gpus),
                                              start))
    return placements
