"""Colocated engines on GPUs (``megarl.controller.placement``): each engine's ranks are the actor's
ranks sorted by (node, GPU), cut into groups of ``rollout.tp``, whatever order Ray's bundles came
in; its ``base_gpu_id`` starts it on its own GPUs (before, every engine of a node took GPUs
0..tp-1), and placements an engine cannot have are refused naming rollout.tp and the GPUs."""

from __future__ import annotations

import random

import pytest

from megarl.controller.placement import PlacementError, bundle_order, colocated_engine_placements


def shuffled_bundles(nodes: int, gpus: int = 8, seed: int = 0) -> list[tuple[str, int]]:
    """(node, GPU) of each bundle of a pool of ``nodes`` whole nodes, in a shuffled order."""
    bundles = [(f"node-{n}", g) for n in range(nodes) for g in range(gpus)]
    random.Random(seed).shuffle(bundles)
    return bundles


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_engines_take_the_sorted_ranks(tp, nodes):
    bundles = shuffled_bundles(nodes, seed=tp * 10 + nodes)
    assert bundles != sorted(bundles)
    placements = colocated_engine_placements(bundles, tp)
    assert len(placements) == nodes * 8 // tp
    for e, p in enumerate(placements):
        node, first = divmod(e * tp, 8)  # the sorted assignment: engine e on GPUs e*tp.. of its node
        assert p.node == f"node-{node}"
        assert p.gpu_ids == tuple(range(first, first + tp))
        assert p.base_gpu_id == first
        assert p.node_gpu_ids == tuple(range(8)) and p.visible_devices == "0,1,2,3,4,5,6,7"
        assert [bundles[rank] for rank in p.ranks] == [(p.node, g) for g in p.gpu_ids]  # its ranks' bundles
    # every rank in exactly one engine
    assert sorted(rank for p in placements for rank in p.ranks) == list(range(nodes * 8))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_ranks_in_bundle_order_keep_tensor_parallel_groups_and_engines_on_consecutive_gpus(tp):
    """Megatron rank r runs in bundle ``bundle_order(...)[r]``: every group of ``tp`` consecutive
    ranks (a TP group; a colocated engine's ranks) is on one node and consecutive GPUs, and engine e
    takes exactly ranks e*tp .. e*tp+tp-1, whatever order Ray's bundles came in."""
    bundles = shuffled_bundles(2, seed=tp)
    reports = [(f"10.0.0.{10 if node == 'node-0' else 9}", [gpu]) for node, gpu in bundles]
    order = bundle_order(reports)
    assert sorted(order) == list(range(16))
    rank_gpus = [(reports[bundle][0], reports[bundle][1][0]) for bundle in order]
    assert rank_gpus == [("10.0.0.9", g) for g in range(8)] + [("10.0.0.10", g) for g in range(8)]  # numeric IPs
    for start in range(0, 16, tp):
        group = rank_gpus[start:start + tp]
        assert len({node for node, _ in group}) == 1 and [g for _, g in group] == list(range(group[0][1], group[0][1] + tp))
    placements = colocated_engine_placements(rank_gpus, tp)
    assert [p.ranks for p in placements] == [tuple(range(e * tp, e * tp + tp)) for e in range(16 // tp)]


def test_cpu_bundles_keep_their_order_within_a_node():
    assert bundle_order([("b", []), ("a", []), ("b", []), ("a", [])]) == [1, 3, 0, 2]


def test_sorted_bundles_keep_the_rank_order():
    placements = colocated_engine_placements([("a", g) for g in range(8)], 2)
    assert [p.ranks for p in placements] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [p.base_gpu_id for p in placements] == [0, 2, 4, 6]


def test_a_pool_on_part_of_a_node_counts_from_its_first_gpu():
    # the pool holds GPUs 4..7 of the node: they are what the engines see, indexed from 0
    placements = colocated_engine_placements([("a", 6), ("a", 4), ("a", 7), ("a", 5)], 2)
    assert [(p.ranks, p.gpu_ids, p.base_gpu_id) for p in placements] == [((1, 3), (4, 5), 0), ((0, 2), (6, 7), 2)]
    assert {p.visible_devices for p in placements} == {"4,5,6,7"}


def test_an_engine_straddling_nodes_is_refused():
    # 12 ranks, 6 per node: tp=4 divides the pool but not a node
    bundles = [(n, g) for n in ("a", "b") for g in range(6)]
    with pytest.raises(PlacementError, match=r"rollout.tp=4 does not divide the 6 GPU\(s\) \[0, 1, 2, 3, 4, 5\] "
                                             r"of node a .* straddle nodes"):
        colocated_engine_placements(bundles, 4)


def test_non_consecutive_gpus_are_refused():
    with pytest.raises(PlacementError, match=r"rollout.tp=2: engine 1 would run on GPUs \[2, 5\] of node a .*"
                                             r"not 2 consecutive local GPU ids"):
        colocated_engine_placements([("a", 0), ("a", 5), ("a", 1), ("a", 2)], 2)


@pytest.mark.parametrize("bundles, tp, message", [
    ([("a", 0), ("a", 0)], 1, r"node a: GPU\(s\) \[0\] reported for more than one rank"),
    ([("a", "GPU-3f2a")], 1, r"rank 0 on node a: Ray reported GPU id 'GPU-3f2a', not a local GPU index"),
    ([], 1, "no actor ranks"),
    ([("a", 0)], 0, r"rollout.tp=0: must be >= 1"),
])
def test_bad_reports_are_refused(bundles, tp, message):
    with pytest.raises(PlacementError, match=message):
        colocated_engine_placements(bundles, tp)


# ------------------------------------------------------------------ the GPU wiring, with Ray faked
# (no GPU here; the CPU path runs for real in every run test)
class FakeRemote:
    """``ray.remote(...)(cls)``: records each actor's bundle and arguments instead of starting it."""

    started: list = []

    def __init__(self, *args, **opts):
        pass

    def __call__(self, cls):
        return self

    def options(self, scheduling_strategy):
        bundle = scheduling_strategy.placement_group_bundle_index
        return type("Handle", (), {"remote": lambda _, *args: FakeRemote.started.append((bundle, args))})()


class FakeWorker:
    def __init__(self, node, gpu):
        self.__ray_call__ = type("Call", (), {"remote": lambda _, fn: (node, [gpu])})()


def start_engines(monkeypatch, device, bundles, tp):
    from types import SimpleNamespace

    import ray

    from megarl.controller.rollout_manager import RolloutManager

    monkeypatch.setattr(ray, "remote", FakeRemote)
    FakeRemote.started = []
    cfg = SimpleNamespace(
        rollout=SimpleNamespace(tp=tp, placement="colocated", mem_fraction_static=0.5, ep=1, pool="global"),
        trainer=SimpleNamespace(seed=1), actor=SimpleNamespace(routing_replay=False, pool="global",
                                                               sequence_packing=False),
        cluster=SimpleNamespace(device=device), model=SimpleNamespace(dtype="bfloat16"), shared_prompt_rows=False,
        world_size_for=lambda role: len(bundles))
    order = bundle_order([(node, [gpu]) for node, gpu in bundles])  # what WorkerGroup does: rank r in bundle order[r]
    workers = SimpleNamespace(placements={"global": object()}, threads=3, bundles={"global": order},
                              role_workers={"actor": [FakeWorker(*bundles[b]) for b in order]},
                              names=lambda role: [f"rank {i}" for i in range(len(bundles))],
                              gather=lambda refs, who, phase: list(refs))
    manager = RolloutManager.__new__(RolloutManager)
    manager.cfg, manager.workers, manager.model_dir, manager.log = cfg, workers, "/model", lambda line: None
    settings = {"mem_fraction_static": 0.5, "startup_timeout_s": 600.0, "call_timeout_s": 300.0}  # as engine_settings gives them
    assert len(manager._start_engines(settings)) == len(bundles) // tp
    return FakeRemote.started


def test_gpu_engines_start_in_their_first_ranks_bundle_on_their_own_gpus(monkeypatch):
    bundles = shuffled_bundles(2, seed=3)
    started = start_engines(monkeypatch, "gpu", bundles, 4)
    for e, (bundle, (model, tp, dtype, kwargs)) in enumerate(started):
        node, first = divmod(e * 4, 8)
        assert bundles[bundle] == (f"node-{node}", first) and (model, tp, dtype) == ("/model", 4, "bfloat16")
        assert kwargs["base_gpu_id"] == first and kwargs["env"] == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
        assert kwargs["mem_fraction_static"] == 0.5

