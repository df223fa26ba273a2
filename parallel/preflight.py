"""Pre-flight check of a multi-node allocation, before Ray or any model starts.

One task per node (``srun --ntasks-per-node=1 megarl preflight ...``). Each task reports its host,
how many GPUs it sees (against the expected count) and its host facts (``parallel.preflight_host``:
ulimits, /dev/shm, driver, ECC and XID state). Rank 0 hosts the rendezvous (a TCPStore on
``master_addr:port``), then every task starts one process per GPU of its node (NCCL; on CPU,
``ranks_per_node`` gloo processes, default 1), and all of them join one process group:

- a small all_reduce over every rank, its result checked;
- a large all_reduce (``nbytes``) within each node and over all ranks of all nodes, checked, then
  ``warmup`` untimed and ``iters`` timed iterations; the bus bandwidth as nccl-tests computes it
  (algbw x 2(n-1)/n, the slowest rank's time), judged against ``Floors`` on NCCL (none on gloo);
- NCCL's INFO log of every GPU rank (``NCCL_DEBUG_FILE``): between nodes the transport must not
  be ``NET/Socket`` (NCCL's silent fallback when RDMA is unusable).

Rank 0 writes the verdict; every task exits with it. Every wait is bounded by ``timeout_s``, and
every failure names the node (host name), the check, the measured value and the floor:

- a rank that never reaches the rendezvous: rank 0 names the missing rank(s) and, when the
  expected host of each rank is known (``hosts``), their host names;
- a rank that cannot reach rank 0: it names rank 0's address and host;
- a node with the wrong GPU count, failed host checks, a failed or slow collective: in the verdict.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

from parallel.preflight_host import Floors, bus_bandwidth_gb_s, host_facts, judge_host, nccl_net_transports

_PREFIX = "megarl-preflight"
_RESULT = "megarl-preflight-result "
DEFAULT_BYTES = {"nccl": 1 << 30, "gloo": 1 << 22}  # 1 GiB on GPUs; 4 MiB on CPU


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
    facts: dict = field(default_factory=dict)


@dataclass
class PreflightResult:
    ok: bool
    world_size: int  # nodes
    backend: str
    nodes: list[dict]
    problems: list[str]
    warnings: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # collective ranks per node
    nbytes: int = 0
    iters: int = 0
    intra: list[dict] = field(default_factory=list)  # per node: {"rank", "host", "ranks", "seconds", "bus_gb_s"}
    inter: dict | None = None  # {"seconds", "bus_gb_s"} over all ranks of all nodes
    transports: list[dict] = field(default_factory=list)  # per node: {"rank", "host", "net": NCCL NET transports}

    def summary(self) -> str:
        lines = [f"preflight: {self.world_size} node(s), backend {self.backend}: {'OK' if self.ok else 'FAILED'}"]
        for node, ranks in zip(self.nodes, self.ranks or [None] * len(self.nodes)):
            expect = "" if node["gpus_expected"] is None else f" (expected {node['gpus_expected']})"
            f = node["facts"]
            memlock = "unlimited" if f.get("memlock") is None else f"{f['memlock'] // 1024} KiB"
            shm = "?" if f.get("shm_gib") is None else f"{f['shm_gib']:.1f} GiB"
            driver = f.get("nvidia_smi", {}).get("driver") if isinstance(f.get("nvidia_smi"), dict) else None
            lines.append(f"preflight:   rank {node['rank']} {node['host']}: {node['gpus_visible']} GPU(s) visible{expect}"
                         f"{'' if ranks is None else f', {ranks} rank(s)'}; ulimit -l {memlock}, -n {f.get('nofile')}; "
                         f"/dev/shm {shm}{f'; driver {driver}' if driver else ''}")
        size = f"{self.nbytes / 2**20:.0f} MiB x {self.iters}"
        for m in self.intra:
            lines.append(f"preflight:   intra-node all_reduce ok on rank {m['rank']} {m['host']} ({m['ranks']} ranks): "
                         f"{size}, {m['seconds'] * 1e3:.2f} ms, bus bandwidth {m['bus_gb_s']:.2f} GB/s")
        if self.inter:
            lines.append(f"preflight:   inter-node all_reduce ok over {self.world_size} node(s), {sum(self.ranks)} ranks: "
                         f"{size}, {self.inter['seconds'] * 1e3:.2f} ms, bus bandwidth {self.inter['bus_gb_s']:.2f} GB/s")
        for t in self.transports:
            lines.append(f"preflight:   NCCL between nodes on rank {t['rank']} {t['host']}: "
                         f"{', '.join('NET/' + n for n in t['net']) or 'no NET channel'}")
        lines += [f"preflight: WARNING: {w}" for w in self.warnings]
        lines += [f"preflight: ERROR: {p}" for p in self.problems]
        return "\n".join(lines)


def local_report(rank: int, gpus_expected: int | None) -> NodeReport:
    """This node's name, GPU count (and whether it is what the job asked for) and host facts."""
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    report = NodeReport(rank, socket.gethostname(), visible, gpus_expected, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if gpus_expected is not None and visible != gpus_expected:
        report.problems.append(f"{report.host} (rank {rank}): {visible} GPU(s) visible, expected {gpus_expected} "
                               f"(CUDA_VISIBLE_DEVICES={report.cuda_visible_devices!r})")
    report.facts = host_facts(gpu=visible > 0 and gpus_expected != 0)
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


def _timed_all_reduce(group, nbytes: int, iters: int, warmup: int, device) -> float:
    """Seconds per all_reduce of ``nbytes`` fp32 over ``group`` (None: all ranks), after checking
    one (each rank's buffer holds its group rank + 1: the sum is n(n+1)/2) and ``warmup`` more."""
    import torch
    import torch.distributed as dist

    n, me = dist.get_world_size(group), dist.get_rank(group)
    buffer = torch.full((max(1, nbytes // 4),), float(me + 1), device=device)
    dist.all_reduce(buffer, group=group)
    expected = n * (n + 1) / 2
    if not bool(torch.all(buffer == expected)):
        raise PreflightError(f"all_reduce over {n} ranks returned {buffer[:4].tolist()}..., expected {expected} everywhere")
    buffer.zero_()  # the timed sums stay 0: no overflow over many iterations
    for _ in range(warmup):
        dist.all_reduce(buffer, group=group)
    dist.barrier(group=group)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buffer, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / max(1, iters)


def _rank_main(plan: dict) -> dict:
    """One collective rank (a process of its own, ``python -m parallel.preflight PLAN``)."""
    import torch
    import torch.distributed as dist

    counts, node, rank = plan["counts"], plan["node"], plan["rank"]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    if plan["backend"] == "nccl":
        torch.cuda.set_device(rank - starts[node])
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=plan["timeout_s"])
    store = dist.TCPStore(plan["master_addr"], plan["master_port"], None, False, timeout)
    dist.init_process_group(plan["backend"], store=dist.PrefixStore(f"{_PREFIX}/pg", store), rank=rank,
                            world_size=sum(counts), timeout=timeout)
    try:
        world = sum(counts)
        probe = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(probe)
        if not torch.allclose(probe.cpu(), torch.full((4,), world * (world + 1) / 2)):
            raise PreflightError(f"all_reduce returned {probe.tolist()}, expected {world * (world + 1) / 2} everywhere")
        # Every rank creates every node's group, in the same order (torch.distributed requires it).
        groups = [dist.new_group(list(range(s, s + c))) if c > 1 else None for s, c in zip(starts, counts)]
        timing = dict(nbytes=plan["nbytes"], iters=plan["iters"], warmup=plan["warmup"], device=device)
        intra = _timed_all_reduce(groups[node], **timing) if counts[node] > 1 else None
        inter = _timed_all_reduce(None, **timing) if len(counts) > 1 else None
        return {"intra_s": intra, "inter_s": inter}
    finally:
        dist.destroy_process_group()


def _run_node_ranks(node: int, go: dict, master_addr: str, master_port: int, deadline: float) -> dict:
    """Start this node's collective ranks, wait for them (killed at ``deadline``); the node's
    slowest times, its problems and the NCCL NET transports its ranks' INFO logs name."""
    host, counts = socket.gethostname(), go["counts"]
    first = sum(counts[:node])
    outcome: dict = {"host": host, "problems": [], "intra_s": None, "inter_s": None, "transports": []}
    with tempfile.TemporaryDirectory(prefix="megarl-preflight-") as tmp:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                           os.environ.get("PYTHONPATH", "")]))
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // counts[node])))
        procs = []
        for local in range(counts[node]):
            if go["backend"] == "nccl":  # NCCL's own account of its transports, per rank
                env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_DEBUG_FILE=f"{tmp}/nccl.{local}.log")
            plan = dict(go, node=node, rank=first + local, master_addr=master_addr, master_port=master_port,
                        timeout_s=max(1.0, deadline - time.monotonic()))
            with open(f"{tmp}/out.{local}", "w") as out, open(f"{tmp}/err.{local}", "w") as err:
                procs.append(subprocess.Popen([sys.executable, "-m", "parallel.preflight", json.dumps(plan)], env=env,
                                              stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True))
        for local, proc in enumerate(procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                proc.wait()
            text = Path(f"{tmp}/out.{local}").read_text()
            found = [line[len(_RESULT):] for line in text.splitlines() if line.startswith(_RESULT)]
            if not found:
                err = Path(f"{tmp}/err.{local}").read_text().strip().splitlines()
                why = err[-1] if err else f"exit status {proc.returncode}" if proc.returncode is not None else "killed"
                outcome["problems"].append(f"{host} (rank {first + local}, local {local}): {go['backend']} collective "
                                           f"failed{' (timed out)' if proc.returncode == -signal.SIGKILL else ''}: {why}")
                continue
            result = json.loads(found[-1])
            for key in ("intra_s", "inter_s"):
                if result[key] is not None:
                    outcome[key] = max(outcome[key] or 0.0, result[key])
        logs = "".join(p.read_text(errors="replace") for p in sorted(Path(tmp).glob("nccl.*.log")))
        outcome["transports"] = nccl_net_transports(logs)
    return outcome


def _plan(reports: list[dict], gpus_per_node: int | None, backend: str | None, ranks_per_node: int | None,
          nbytes: int | None, iters: int, warmup: int) -> tuple[dict, list[str]]:
    """Rank 0's plan of the collective (backend, ranks per node, size) from every node's report,
    and the problems that make a node unable to follow it."""
    visible = [r["gpus_visible"] for r in reports]
    backend = backend or ("nccl" if gpus_per_node != 0 and all(v > 0 for v in visible) else "gloo")
    problems = []
    if backend == "nccl":
        counts = [ranks_per_node or v for v in visible]
        problems = [f"{r['host']}: --ranks-per-node {ranks_per_node} but {v} GPU(s) visible (one rank per GPU)"
                    for r, v in zip(reports, visible) if ranks_per_node and ranks_per_node > v]
    else:
        counts = [ranks_per_node or 1] * len(reports)
    return dict(backend=backend, counts=counts, nbytes=nbytes or DEFAULT_BYTES[backend], iters=iters,
                warmup=warmup), problems


def judge_outcomes(go: dict, reports: list[dict], outcomes: dict[int, dict], missing: list[int], floors: Floors,
             hosts: list[str] | None, timeout_s: float) -> PreflightResult:
    """Rank 0's judgement of every node's report and collective outcome."""
    nccl, multi = go["backend"] == "nccl", len(reports) > 1
    problems = [p for rep in reports for p in rep["problems"]]
    warnings: list[str] = []
    for rep in reports:
        bad, warn = judge_host(rep["host"], rep["facts"], gpu=nccl, multi_node=multi, floors=floors)
        problems += bad
        warnings += warn
    drivers = {r["host"]: r["facts"]["nvidia_smi"]["driver"] for r in reports
               if isinstance(r["facts"].get("nvidia_smi"), dict)}
    if len(set(drivers.values())) > 1:
        problems.append("NVIDIA drivers differ between nodes: " + ", ".join(f"{h} {d}" for h, d in drivers.items()))
    problems += [p for r in sorted(outcomes) for p in outcomes[r]["problems"]]
    problems += [f"{_name(r, hosts)}: no collective result within {timeout_s:.0f}s" for r in missing]
    result = PreflightResult(False, len(reports), go["backend"], reports, problems, warnings, go["counts"],
                             go["nbytes"], go["iters"])
    done = [outcomes[r] for r in sorted(outcomes) if not outcomes[r]["problems"]]
    for r, out in sorted(outcomes.items()):
        if out["intra_s"] is None:
            continue
        n = go["counts"][r]
        bus = bus_bandwidth_gb_s(go["nbytes"], out["intra_s"], n)
        result.intra.append({"rank": r, "host": out["host"], "ranks": n, "seconds": out["intra_s"], "bus_gb_s": bus})
        if nccl and floors.intra_node_gb_s and bus < floors.intra_node_gb_s:
            problems.append(f"{out['host']}: intra-node all_reduce over its {n} GPUs: bus bandwidth {bus:.1f} GB/s, "
                            f"below the floor {floors.intra_node_gb_s:g} GB/s (--intra-node-floor-gb-s)")
    if multi and len(done) == len(reports):
        seconds = max(out["inter_s"] for out in done)
        bus = bus_bandwidth_gb_s(go["nbytes"], seconds, sum(go["counts"]))
        result.inter = {"seconds": seconds, "bus_gb_s": bus}
        if nccl and floors.inter_node_gb_s and bus < floors.inter_node_gb_s:
            problems.append(f"inter-node all_reduce over {', '.join(o['host'] for o in done)} ({sum(go['counts'])} "
                            f"ranks): bus bandwidth {bus:.1f} GB/s, below the floor {floors.inter_node_gb_s:g} GB/s "
                            f"(--inter-node-floor-gb-s); the transport lines name each node's network")
    if nccl and multi:
        for r, out in sorted(outcomes.items()):
            if out["problems"]:
                continue
            rep = reports[r]
            names = out["transports"]
            result.transports.append({"rank": r, "host": out["host"], "net": sorted(names)})
            if "Socket" in names:
                why = (f"{out['host']}: NCCL runs between nodes over sockets, not RDMA (NCCL INFO: "
                       f"'{names['Socket']}'); /dev/infiniband: {' '.join(rep['facts']['infiniband']) or 'absent'}, "
                       f"ulimit -l: {'unlimited' if rep['facts']['memlock'] is None else rep['facts']['memlock']}; "
                       f"check the RDMA devices, memlock and NCCL_IB_HCA")
                (warnings if floors.allow_nccl_socket else problems).append(
                    why + ("" if floors.allow_nccl_socket else "; --allow-nccl-socket accepts it"))
            elif not names:
                warnings.append(f"{out['host']}: NCCL's INFO log named no network transport between nodes")
    result.ok = not problems
    return result


def run_preflight(rank: int, world: int, master_addr: str, master_port: int, *, hosts: list[str] | None = None,
                  gpus_per_node: int | None = None, timeout_s: float = 60.0, nbytes: int | None = None,
                  backend: str | None = None, ranks_per_node: int | None = None, iters: int = 10, warmup: int = 3,
                  floors: Floors | None = None) -> PreflightResult:
    """Run this node's part of the check; returns the verdict (the same on every node that got it).

    Raises ``PreflightError`` (naming the nodes) when the rendezvous itself fails: this node cannot
    reach rank 0, or (on rank 0) some nodes never arrived within ``timeout_s``."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout_s
    report = local_report(rank, gpus_per_node)
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
        reports = [json.loads(store.get(f"{_PREFIX}/report/{r}")) for r in range(world)]
        go, plan_problems = _plan(reports, gpus_per_node, backend, ranks_per_node, nbytes, iters, warmup)
        store.set(f"{_PREFIX}/go", json.dumps(go))
    else:
        try:
            if len(_wait_keys(store, [f"{_PREFIX}/go", f"{_PREFIX}/verdict"], deadline, any_of=True)) == 2:
                raise PreflightError(f"{report.host} (rank {rank}): rank 0 at {master} gave no go-ahead "
                                     f"within {timeout_s:.0f}s")
            if store.check([f"{_PREFIX}/verdict"]):  # rank 0 gave up: some other rank is missing
                error = json.loads(store.get(f"{_PREFIX}/verdict"))["error"]
                store.set(f"{_PREFIX}/read/{rank}", "1")
                raise PreflightError(error)
            go = json.loads(store.get(f"{_PREFIX}/go"))
        except PreflightError:
            raise
        except Exception as error:  # noqa: BLE001 - the store went away with rank 0
            raise PreflightError(f"{report.host} (rank {rank}): lost the rendezvous with rank 0 at {master}: "
                                 f"{error}") from error

    # The ranks stop short of the deadline, so that every node's outcome still reaches rank 0 in time.
    outcome = _run_node_ranks(rank, go, master_addr, master_port, deadline - min(10.0, timeout_s / 5))
    store.set(f"{_PREFIX}/outcome/{rank}", json.dumps(outcome))

    if rank == 0:
        keys = [f"{_PREFIX}/outcome/{r}" for r in range(world)]
        missing = _wait_keys(store, keys, deadline)
        outcomes = {r: json.loads(store.get(keys[r])) for r in range(world) if keys[r] not in missing}
        result = judge_outcomes(go, reports, outcomes, [int(k.rsplit("/", 1)[1]) for k in missing], floors or Floors(), hosts,
                          timeout_s)
        result.problems[:0] = plan_problems
        result.ok = not result.problems
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


if __name__ == "__main__":  # one collective rank, started by _run_node_ranks
    print(_RESULT + json.dumps(_rank_main(json.loads(sys.argv[1]))), flush=True)
