"""Pre-flight check of a multi-node allocation, before Ray or any model starts.

One process per node (``srun --ntasks-per-node=1 megarl preflight ...``). Each rank reports its
host name and how many GPUs it sees (against the expected count), then all ranks join one small
torch.distributed collective (gloo on CPU, NCCL on GPUs): an all_reduce whose result is checked,
and a short bandwidth figure. Rank 0 hosts the rendezvous (a TCPStore on ``master_addr:port``)
and writes the verdict; every rank exits with it.

Every wait is bounded by ``timeout_s``, and every failure names the node(s) at fault:

- a rank that never reaches the rendezvous: rank 0 names the missing rank(s) and, when the
  expected host of each rank is known (``hosts``), their host names;
- a rank that cannot reach rank 0: it names rank 0's address and host;
- a node with the wrong number of GPUs, or whose collective fails: named in the verdict.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta

_PREFIX = "megarl-preflight"


class PreflightError(RuntimeError):
    """The allocation is not usable; the message names the node(s) and what is wrong."""


@dataclass
class NodeReport:
    rank: int
    host: str
    gpus_visible: int
    gpus_expected: int | None
    cuda_visible_devices: str | None
    problems: list[str] = field(default_factory=list)


@dataclass
class PreflightResult:
    ok: bool
    world_size: int
    backend: str
    nodes: list[dict]
    problems: list[str]
    all_reduce_seconds: float | None = None
    bus_bandwidth_gb_s: float | None = None

    def summary(self) -> str:
        lines = [f"preflight: {self.world_size} node(s), backend {self.backend}: {'OK' if self.ok else 'FAILED'}"]
        for node in self.nodes:
            expect = "" if node["gpus_expected"] is None else f" (expected {node['gpus_expected']})"
            lines.append(f"preflight:   rank {node['rank']} {node['host']}: {node['gpus_visible']} GPU(s) visible{expect}")
        if self.all_reduce_seconds is not None:
            lines.append(f"preflight:   all_reduce ok in {self.all_reduce_seconds * 1e3:.1f} ms; "
                         f"bus bandwidth {self.bus_bandwidth_gb_s:.3f} GB/s")
        lines += [f"preflight: ERROR: {p}" for p in self.problems]
        return "\n".join(lines)


def local_report(rank: int, gpus_expected: int | None) -> NodeReport:
    """This node's name and GPU count, and whether the count is what the job asked for."""
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    report = NodeReport(rank, socket.gethostname(), visible, gpus_expected, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if gpus_expected is not None and visible != gpus_expected:
        report.problems.append(f"{report.host} (rank {rank}): {visible} GPU(s) visible, expected {gpus_expected} "
                               f"(CUDA_VISIBLE_DEVICES={report.cuda_visible_devices!r})")
    return report


def _name(rank: int, hosts: list[str] | None) -> str:
    return f"rank {rank} ({hosts[rank]})" if hosts and rank < len(hosts) else f"rank {rank}"


def _wait_keys(store, keys: list[str], deadline: float, any_of: bool = False) -> list[str]:
    """The keys still missing at ``deadline``, or as soon as all (``any_of``: one) of them exist.
    Polls; never blocks past the deadline."""
    missing = list(keys)
    while missing:
        missing = [k for k in missing if not store.check([k])]
        if not missing or (any_of and len(missing) < len(keys)) or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return missing


def _collective(rank: int, world: int, store, backend: str, nbytes: int, timeout_s: float) -> tuple[float, float]:
    """all_reduce a small tensor (checked) and time a ``nbytes`` one: (seconds, bus GB/s)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend, store=dist.PrefixStore(f"{_PREFIX}/pg", store), rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
        probe = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(probe)
        expected = world * (world + 1) / 2
        if not torch.allclose(probe.cpu(), torch.full((4,), expected)):
            raise PreflightError(f"all_reduce returned {probe.tolist()}, expected {expected} everywhere")
        payload = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        dist.all_reduce(payload)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dist.all_reduce(payload)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        bus = 2 * (world - 1) / world * payload.numel() * 4 / max(seconds, 1e-9) / 1e9 if world > 1 else 0.0
        return seconds, bus
    finally:
        dist.destroy_process_group()


def run_preflight(rank: int, world: int, master_addr: str, master_port: int, *, hosts: list[str] | None = None,
                  gpus_per_node: int | None = None, timeout_s: float = 60.0, nbytes: int = 1 << 22,
                  backend: str | None = None) -> PreflightResult:
    """Run this rank's part of the check; returns the verdict (the same on every rank that got it).

    Raises ``PreflightError`` (naming the nodes) when the rendezvous itself fails: this rank cannot
    reach rank 0, or (on rank 0) some ranks never arrived within ``timeout_s``."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout_s
    report = local_report(rank, gpus_per_node)
    if backend is None:
        backend = "nccl" if gpus_per_node and report.gpus_visible > 0 else "gloo"
    master = f"{master_addr}:{master_port}" + (f" on {hosts[0]}" if hosts else "")
    try:
        store = dist.TCPStore(master_addr, master_port, world, rank == 0, timedelta(seconds=timeout_s),
                              wait_for_workers=False)
    except Exception as error:  # noqa: BLE001 - any connect failure is reported the same way
        raise PreflightError(f"{report.host} (rank {rank}) cannot reach the rendezvous of rank 0 at {master} "
                             f"within {timeout_s:.0f}s: {error}") from error
    store.set(f"{_PREFIX}/report/{rank}", json.dumps(asdict(report)))

    if rank == 0:
        missing = _wait_keys(store, [f"{_PREFIX}/report/{r}" for r in range(world)], deadline)
        if missing:
            ranks = sorted(int(k.rsplit("/", 1)[1]) for k in missing)
            message = (f"{len(ranks)} of {world} node(s) never joined the rendezvous at {master} within "
                       f"{timeout_s:.0f}s: {', '.join(_name(r, hosts) for r in ranks)}")
            store.set(f"{_PREFIX}/verdict", json.dumps({"error": message}))
            arrived = [r for r in range(1, world) if r not in ranks]  # let them read why, briefly
            _wait_keys(store, [f"{_PREFIX}/read/{r}" for r in arrived], time.monotonic() + 5)
            raise PreflightError(message)
        store.set(f"{_PREFIX}/go", "1")
    else:
        try:
            if len(_wait_keys(store, [f"{_PREFIX}/go", f"{_PREFIX}/verdict"], deadline, any_of=True)) == 2:
                raise PreflightError(f"{report.host} (rank {rank}): rank 0 at {master} gave no go-ahead "
                                     f"within {timeout_s:.0f}s")
            if store.check([f"{_PREFIX}/verdict"]):  # rank 0 gave up: some other rank is missing
                error = json.loads(store.get(f"{_PREFIX}/verdict"))["error"]
                store.set(f"{_PREFIX}/read/{rank}", "1")
                raise PreflightError(error)
        except PreflightError:
            raise
        except Exception as error:  # noqa: BLE001 - the store went away with rank 0
            raise PreflightError(f"{report.host} (rank {rank}): lost the rendezvous with rank 0 at {master}: "
                                 f"{error}") from error

    outcome: dict = {"host": report.host, "problems": []}
    try:
        outcome["seconds"], outcome["bus_gb_s"] = _collective(rank, world, store, backend, nbytes,
                                                               max(1.0, deadline - time.monotonic()))
    except Exception as error:  # noqa: BLE001 - reported by name below
        outcome["problems"].append(f"{report.host} (rank {rank}): {backend} collective failed: "
                                   f"{str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}")
    store.set(f"{_PREFIX}/outcome/{rank}", json.dumps(outcome))

    if rank == 0:
        keys = [f"{_PREFIX}/outcome/{r}" for r in range(world)]
        missing = _wait_keys(store, keys, deadline)
        reports = [json.loads(store.get(f"{_PREFIX}/report/{r}")) for r in range(world)]
        outcomes = {r: json.loads(store.get(keys[r])) for r in range(world) if keys[r] not in missing}
        problems = [p for rep in reports for p in rep["problems"]]
        problems += [p for r in sorted(outcomes) for p in outcomes[r]["problems"]]
        problems += [f"{_name(int(k.rsplit('/', 1)[1]), hosts)}: no collective result within {timeout_s:.0f}s"
                     for k in missing]
        mine = outcomes.get(0, {})
        result = PreflightResult(not problems, world, backend, reports, problems, mine.get("seconds"),
                                 mine.get("bus_gb_s"))
        store.set(f"{_PREFIX}/verdict", json.dumps(asdict(result)))
        # Keep the store (it lives in this process) up until every rank has read the verdict.
        _wait_keys(store, [f"{_PREFIX}/read/{r}" for r in range(1, world)], min(deadline, time.monotonic() + 10))
        return result
    try:
        if _wait_keys(store, [f"{_PREFIX}/verdict"], deadline):
            raise PreflightError(f"{report.host} (rank {rank}): no verdict from rank 0 at {master} "
                                 f"within {timeout_s:.0f}s")
        verdict = json.loads(store.get(f"{_PREFIX}/verdict"))
        store.set(f"{_PREFIX}/read/{rank}", "1")
    except PreflightError:
        raise
    except Exception as error:  # noqa: BLE001 - the store went away with rank 0
        raise PreflightError(f"{report.host} (rank {rank}): lost the rendezvous with rank 0 at {master}: "
                             f"{error}") from error
    if "error" in verdict:
        raise PreflightError(verdict["error"])
    return PreflightResult(**verdict)
