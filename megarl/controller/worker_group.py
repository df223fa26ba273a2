"""The Megatron ranks of a run as Ray actors: Ray's start, one placement group and one
torch.distributed group per resource pool, and every call to the ranks with a deadline.

A pool's ranks run every Megatron role placed on it (``RunConfig.megatron_pools``: by default
actor, reference and critic share the actor's). A call that a rank does not answer in time, or
that a rank dies in, raises ``RunError`` naming the rank and the phase: a run never hangs silently.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable

import torch

from megarl.config.schema import RunConfig
from megarl.faults import FaultPlan


class RunError(RuntimeError):
    """The run cannot continue (a resume mismatch, a failed weight sync, ...); says why and the fix."""


class WorkerGroup:
    """One ``MegatronWorker`` per rank of each pool a Megatron role uses; ``then()`` is what an
    error tells the user to do next (how to resume)."""

    def __init__(self, cfg: RunConfig, log: Callable[[str], None], faults: FaultPlan, then: Callable[[], str]):
        import ray

        from megarl.workers.megatron_worker import MegatronWorker

        self.cfg, self.log, self.faults, self.then = cfg, log, faults, then
        gpu = cfg.cluster.device == "gpu"
        self.threads = start_ray(cfg)
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        worker_cls = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(MegatronWorker)
        env = megatron_worker_env(cfg)
        runtime = {"runtime_env": {"env_vars": env}} if env else {}
        # pool -> its placement group, the bundle of each rank, its Megatron workers
        self.placements, self.bundles, self.groups = {}, {}, {}
        for pool in cfg.megatron_pools():
            size = cfg.cluster.pool_sizes()[pool]
            pg = self.placements[pool] = ready_placement_group([bundle] * size)
            order = self.bundles[pool] = ranks_in_node_order(pg, size, gpu) if gpu or cfg.cluster.nodes > 1 \
                else list(range(size))
            # max_calls=1: the task's worker process exits after it (idle, it would keep ~200 MB of imports)
            address, port = ray.get(ray.remote(num_cpus=0, max_calls=1)(_address).options(
                **in_bundle(pg, order[0])).remote())
            # a collective may wait as long as a phase may last (the first one, after setup, waits for
            # the slowest rank's load): torch.distributed's watchdog must not abort it sooner
            self.groups[pool] = [worker_cls.options(**in_bundle(pg, order[rank]), **runtime).remote(
                rank, size, address, port, self.threads, timeout_s=cfg.trainer.phase_timeout_s, group=pool)
                for rank in range(size)]
        self.role_workers = {role: self.groups[cfg.pool_for(role)] for role in cfg.megatron_roles}

    def setup(self, specs: list, model_dir: str) -> list[dict]:
        """Build every role's model on its ranks (``specs``: ``ModelSpec`` per role, the actor's
        first, starting from ``model_dir``); each rank's description of what it built, in that order."""
        built = self.gather([w.setup.remote(spec, self.cfg.trainer.seed) for spec in specs
                             for w in self.role_workers[spec.role]],
                            [name for spec in specs for name in self.names(spec.role)], "model setup")
        pools = "; ".join(f"pool {pool!r}: {len(self.groups[pool])} rank(s) of {'+'.join(roles)} "
                          f"(layout {self.cfg.layout_for(roles[0])})" for pool, roles in self.cfg.megatron_pools().items())
        self.log(f"megarl: Megatron {pools} ({self.threads} CPU thread(s) per rank); model {model_dir}")
        return built

    def gather(self, refs: list, who: list[str], phase: str) -> list:
        """``gather`` within ``trainer.phase_timeout_s``, errors ending with ``then()``."""
        return gather(refs, who, phase, self.cfg.trainer.phase_timeout_s, self.then)

    def names(self, role: str | None = None) -> list[str]:
        """How errors name the workers of ``role`` (default: all), in ``call`` order."""
        pools = [self.cfg.pool_for(role)] if role else list(self.groups)
        return [f"Megatron rank {rank} of pool {pool!r}" for pool in pools for rank in range(len(self.groups[pool]))]

    def call(self, method: str, *args, role: str | None = None) -> list:
        """``method`` on every rank of ``role``'s group (default: every Megatron worker), in lockstep."""
        workers = self.role_workers[role] if role else [w for group in self.groups.values() for w in group]
        return self.gather([getattr(w, method).remote(*args) for w in workers], self.names(role), method)

    def forward(self, batch: dict, wanted: dict[str, tuple[str, str]]) -> dict[str, torch.Tensor]:
        """Forward-only outputs for the whole batch, in row order: ``wanted`` maps a batch key to
        (role, output), e.g. ``{"ref_logp": ("ref", "logp")}``. All roles are asked at once, so
        roles on pools of their own compute concurrently."""
        import ray

        shared = ray.put(batch)  # serialized once for every rank and role
        pending = {key: [w.forward.remote(role, shared, False) for w in self.role_workers[role]]
                   for key, (role, _) in wanted.items()}
        outputs = {}
        for key, refs in pending.items():
            parts = [p for p in self.gather(refs, self.names(wanted[key][0]), f"forward ({key})") if p is not None]
            order = torch.cat([p["rows"] for p in parts]).argsort()
            outputs[key] = torch.cat([p[wanted[key][1]] for p in parts])[order]
        return outputs

    def update(self, batch: dict, step: int) -> dict[str, float]:
        """``ppo_epochs`` passes over mini-batches of (1-based) step ``step``'s batch: one optimizer
        step of the actor (and critic) each; metrics are averaged over the steps. Every call is
        queued at once: a worker runs its calls in order, and a critic on a pool of its own trains
        while the actor does."""
        import ray

        from megarl.workers.batch import response_mask

        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        rows = len(batch["uid"])
        if self.faults.fire("kill_megatron_worker", step):
            self.kill_rank("actor", len(self.role_workers["actor"]) - 1, f"as step {step}'s update begins")
        calls = []  # each update call's replies, one per rank (rank 0's: the mini-batch's metrics)
        roles = [("actor", self.cfg.actor)] + ([("critic", self.cfg.critic)] if self.cfg.critic.enabled else [])
        for role, section in roles:
            size = (section.mini_batch_size or self.cfg.data.batch_size) * self.cfg.rollout.n
            for _ in range(section.ppo_epochs):
                for start in range(0, rows, size):
                    mini = {k: v[start:start + size] for k, v in tensors.items()}
                    mask = response_mask(mini)
                    counts = {"tokens": float(mask.sum()), "sequences": float((mask.sum(-1) > 0).sum())}
                    shared = ray.put(mini)  # serialized once for every rank
                    calls.append((role, [w.update.remote(role, shared, counts) for w in self.role_workers[role]]))
        seen: dict[str, list[float]] = {}
        for role, refs in calls:
            for key, value in self.gather(refs, self.names(role), f"update ({role})")[0].items():
                seen.setdefault(key, []).append(value)
        return {key: sum(values) / len(values) for key, values in seen.items()}

    def kill_rank(self, role: str, rank: int, when: str) -> None:
        """Fault injection (``kill_megatron_worker``): SIGKILL ``role``'s rank ``rank``, queued ahead
        of its next call, so the other ranks start that call and wait for it in a collective."""
        self.log(f"megarl: fault injection: Megatron rank {rank} of the {role} dies {when}")
        self.role_workers[role][rank].__ray_call__.remote(lambda worker: os.kill(os.getpid(), signal.SIGKILL))


def megatron_worker_env(cfg: RunConfig) -> dict[str, str]:
    """Environment variables of the Megatron workers' processes (not the SGLang engines'). On GPUs
    ``CUDA_DEVICE_MAX_CONNECTIONS=1``: one hardware queue per device, so the GPU runs kernels in
    the order they were launched, which megatron's overlap of communication with computation
    (tensor/sequence-parallel and gradient reduction) relies on. None on CPU."""
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if cfg.cluster.device == "gpu" else {}


def start_ray(cfg: RunConfig) -> int:
    """Join the Ray cluster of ``RAY_ADDRESS`` or start a local one; the CPU threads each rank gets
    (its node's CPUs split between its ranks, nodes of a Ray cluster assumed alike this one). GPU
    ranks use them for the CPU work of loading, converting and saving weights; Ray's default
    (OMP_NUM_THREADS=1 for an actor of one CPU) would leave that on one core."""
    import ray

    gpu = cfg.cluster.device == "gpu"
    cpus = len(os.sched_getaffinity(0))  # what this process may use (Slurm/cgroup/taskset), not the host's count
    on_cluster = bool(os.environ.get("RAY_ADDRESS"))
    if not ray.is_initialized():
        if on_cluster:
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        else:
            # "local": a Ray of our own even when another one runs on this host (Ray would join it)
            ranks = cfg.cluster.world_size
            ray.init(address="local", num_cpus=max(cpus, ranks), num_gpus=ranks if gpu else 0,
                     include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    return max(1, cpus // (cfg.cluster.ranks_per_node if on_cluster else cfg.cluster.world_size))


def gather(refs: list, who: list[str], phase: str, timeout_s: float, then: Callable[[], str] = str) -> list:
    """The results of Ray ``refs`` (one per worker named in ``who``) within ``timeout_s``. A worker
    that died, or that does not answer in time (a hang, e.g. a collective waiting for a dead rank),
    raises RunError naming it and the phase, followed by ``then()`` (what to do, asked only then):
    never a silent hang. Results are taken as they come, so the first death or error stops the
    phase at once, while the other ranks may still wait for the dead one in a collective."""
    import ray

    deadline = time.monotonic() + timeout_s
    names = dict(zip(refs, who))
    results, pending = {}, list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            raise RunError(f"{phase}: {', '.join(names[ref] for ref in pending)} did not finish within "
                           f"trainer.phase_timeout_s={timeout_s:g} s ({len(refs) - len(pending)} of {len(refs)} "
                           f"did): a hang, e.g. a collective waiting for a dead or stuck rank. {then()}".strip())
        try:
            results[done[0]] = ray.get(done[0])
        except ray.exceptions.RayActorError as exc:
            raise RunError(f"{phase}: {names[done[0]]} died ({str(exc).strip().splitlines()[0]}). "
                           f"{then()}".strip()) from exc
    return [results[ref] for ref in refs]


def ready_placement_group(bundles: list[dict]):
    """A placement group of ``bundles`` (packed onto as few nodes as possible), once Ray has
    reserved it; fails after 5 minutes if the cluster cannot hold it."""
    import ray
    from ray.util.placement_group import placement_group

    group = placement_group([dict(b) for b in bundles], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=300)
    except ray.exceptions.GetTimeoutError:
        raise RunError(f"Ray could not reserve {len(bundles)} x {bundles[0]} within 300 s (cluster resources: "
                       f"{ray.cluster_resources()}); check cluster.nodes / pools against the Ray cluster") from None
    return group


def in_bundle(group, index: int) -> dict:
    """Ray options that run an actor or task in bundle ``index`` of placement group ``group``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, index)}


def ranks_in_node_order(group, size: int, gpu: bool) -> list[int]:
    """The bundle of each rank of placement group ``group`` (``placement.bundle_order``): Ray
    reports where each bundle is by running a task in it (holding its GPU, so that Ray names it)."""
    import ray

    from megarl.controller.placement import bundle_order

    where = ray.remote(num_cpus=0, num_gpus=1 if gpu else 0, max_calls=1)(where_this_runs)
    return bundle_order(ray.get([where.options(**in_bundle(group, i)).remote() for i in range(size)]))


def where_this_runs() -> tuple[str, list[int]]:
    """("node IP node id", GPU ids Ray assigned) of this task or actor; the GPU ids are in the
    numbering of the node's ``CUDA_VISIBLE_DEVICES`` values (Ray sets the process's own
    ``CUDA_VISIBLE_DEVICES`` to them, so its torch device is always 0)."""
    import ray

    node = f"{ray.util.get_node_ip_address()} {ray.get_runtime_context().get_node_id()}"
    return node, [int(g) for g in ray.get_gpu_ids()]


def _address() -> tuple[str, int]:
    """(IP, free port) of the node this runs on: rank 0's torch.distributed rendezvous."""
    import ray

    from parallel.spawn import free_port

    return ray.util.get_node_ip_address(), free_port()
