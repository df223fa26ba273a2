"""What one node of an allocation has, and whether it is fit for a multi-node run (``megarl preflight``).

The facts are gathered on the node (``host_facts``): process limits (``ulimit -l``/``-n``), the
size of /dev/shm, the RDMA devices under /dev/infiniband, and on GPU nodes ``nvidia-smi -q``
(driver version; per GPU: uncorrectable ECC errors, pages pending retirement, row remapping
pending or failed, a reset required) and the NVIDIA XID lines of the kernel log. ``judge_host``
turns them into problems (the node is not fit) and warnings. The parsers are pure functions over
the tools' own text formats, so they are tested without a GPU. So are the two collective helpers
the preflight's ranks use: the nccl-tests bus bandwidth and the NCCL transport read from NCCL's
INFO log (``via NET/IB`` against ``via NET/Socket``: NCCL falls back to sockets silently when it
finds no RDMA device or cannot pin memory).
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
from dataclasses import dataclass

# The oldest driver each CUDA major version runs on (NVIDIA's CUDA toolkit release notes, minor
# version compatibility): torch's CUDA build decides which applies.
MIN_DRIVER_FOR_CUDA = {12: "525.60.13", 13: "580.65.06"}
# XIDs that mean a hardware or firmware fault (NVIDIA's XID catalogue): double-bit ECC (48), PMU
# halt/breakpoint (61, 62), row remapping failure (64), NVLink (74), fallen off the bus (79), high
# single-bit ECC rate (92), contained/uncontained ECC (94, 95), GSP timeout/error (119, 120),
# unrecovered ECC (140). Others (13, 31, 43, 45...) are usually the application's.
HARDWARE_XIDS = frozenset({48, 61, 62, 64, 74, 79, 92, 94, 95, 119, 120, 140})
_XID = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+),")
_NET = re.compile(r"Channel \d+/\d+ : \S+ -> \S+ \[(?:send|receive)\] via NET/([^/\s]+)")


@dataclass(frozen=True)
class Floors:
    """What a node must reach; a floor of 0 (or None) turns its check off."""
    intra_node_gb_s: float = 150.0   # nccl all_reduce bus bandwidth among one node's GPUs
    inter_node_gb_s: float = 40.0    # nccl all_reduce bus bandwidth over all GPUs of all nodes
    shm_gib: float = 64.0            # /dev/shm on a GPU node (CPU nodes: 1 GiB)
    nofile: int = 8192               # ulimit -n (Ray's own recommendation)
    min_driver: str | None = None    # default: MIN_DRIVER_FOR_CUDA of torch's CUDA build
    allow_nccl_socket: bool = False  # accept NCCL over sockets between nodes (an Ethernet-only cluster)


def bus_bandwidth_gb_s(nbytes: int, seconds: float, ranks: int) -> float:
    """nccl-tests' all_reduce bus bandwidth: algbw (bytes / s) x 2(n-1)/n, in GB/s (1e9)."""
    if ranks < 2 or seconds <= 0:
        return 0.0
    return nbytes / seconds * 2 * (ranks - 1) / ranks / 1e9


def nccl_net_transports(log: str) -> dict[str, str]:
    """The NET transports of NCCL's channel lines (``... [send] via NET/IB/0/GDRDMA``): transport
    name ("IB", "Socket", "IBext_v8", "Libfabric", ...) -> the first line that used it."""
    found: dict[str, str] = {}
    for line in log.splitlines():
        match = _NET.search(line)
        if match:
            found.setdefault(match.group(1), line.strip())
    return found


def _limit(which: int) -> int | None:
    soft, _ = resource.getrlimit(which)
    return None if soft == resource.RLIM_INFINITY else soft


def parse_nvidia_smi_q(text: str) -> dict:
    """``nvidia-smi -q`` as {"driver": str | None, "gpus": {bus id: {"Section/Key": value}}}:
    the report is an indented tree of sections and ``Key : Value`` lines, one ``GPU <bus id>``
    section per GPU."""
    driver, gpus, gpu, stack = None, {}, None, []
    for raw in text.splitlines():
        if not raw.strip() or raw.lstrip().startswith("="):
            continue
        indent = len(raw) - len(raw.lstrip())
        key, sep, value = (part.strip() for part in raw.strip().partition(" : "))
        if indent == 0:
            stack = []
            if key.startswith("GPU ") and not sep:
                gpu = gpus.setdefault(key[4:], {})
            elif key == "Driver Version":
                driver = value
            continue
        depth = indent // 4
        del stack[depth - 1:]
        if not sep:
            stack.append(key)
        elif gpu is not None:
            gpu["/".join([*stack, key.rstrip(":").strip()])] = value
    return {"driver": driver, "gpus": gpus}


def gpu_health_problems(gpus: dict[str, dict[str, str]]) -> list[str]:
    """What makes a GPU of ``parse_nvidia_smi_q`` unfit, one line per GPU and fault."""
    problems = []
    for bus, fields in gpus.items():
        counts = {k: int(v) for k, v in fields.items() if k.startswith("ECC Errors/Volatile/")
                  and ("Uncorrectable" in k or "Double Bit" in k) and v.isdigit()}
        totals = [n for k, n in counts.items() if k.endswith("/Total")]  # older drivers: per-unit counts and a total
        uncorrectable = sum(totals) if totals else sum(counts.values())
        if uncorrectable:
            problems.append(f"GPU {bus}: {uncorrectable} uncorrectable ECC error(s) since the driver loaded "
                            f"(nvidia-smi -q: ECC Errors/Volatile)")
        for key, what in (("Retired Pages/Pending Page Blacklist", "pages pending retirement"),
                          ("Retired Pages/Pending", "pages pending retirement"),
                          ("Remapped Rows/Pending", "row remapping pending"),
                          ("Remapped Rows/Remapping Failure Occurred", "row remapping failed"),
                          ("GPU Reset Status/Reset Required", "GPU reset required")):
            if fields.get(key, "").lower() == "yes":
                problems.append(f"GPU {bus}: {what} (nvidia-smi -q: {key}: Yes); the GPU needs a reset or service")
    return problems


def parse_xids(kernel_log: str) -> list[tuple[str, int, str]]:
    """(PCI bus, XID, line) of every NVIDIA XID line (``NVRM: Xid (PCI:0000:18:00): 79, ...``)."""
    return [(m.group(1), int(m.group(2)), line.strip()) for line in kernel_log.splitlines()
            if (m := _XID.search(line))]


def driver_at_least(version: str, floor: str) -> bool:
    """Whether driver ``version`` (e.g. "580.65.06") is ``floor`` or newer (numeric per part)."""
    def parts(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in re.findall(r"\d+", v))
    return parts(version) >= parts(floor)


def _run(cmd: list[str], timeout_s: float = 30) -> tuple[int, str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as error:
        return -1, str(error)
    return proc.returncode, proc.stdout if proc.returncode == 0 else (proc.stdout + proc.stderr).strip()[:300]


def host_facts(gpu: bool) -> dict:
    """This node's facts (JSON-serialisable); ``gpu``: also ``nvidia-smi -q`` and the kernel's XID lines."""
    facts: dict = {"memlock": _limit(resource.RLIMIT_MEMLOCK), "nofile": _limit(resource.RLIMIT_NOFILE),
                   "infiniband": sorted(os.listdir("/dev/infiniband")) if os.path.isdir("/dev/infiniband") else []}
    try:
        shm = os.statvfs("/dev/shm")
        facts["shm_gib"] = shm.f_blocks * shm.f_frsize / 2**30
    except OSError:
        facts["shm_gib"] = None
    if not gpu:
        return facts
    import torch

    facts["cuda"] = torch.version.cuda
    if shutil.which("nvidia-smi") is None:
        facts["nvidia_smi"] = "nvidia-smi not found on PATH"
    else:
        code, out = _run(["nvidia-smi", "-q"])
        facts["nvidia_smi"] = parse_nvidia_smi_q(out) if code == 0 else f"nvidia-smi -q failed ({code}): {out}"
    code, out = _run(["dmesg"])
    facts["xids"] = parse_xids(out) if code == 0 else f"kernel log unreadable (dmesg: {out.splitlines()[0] if out else code})"
    return facts


def _kib(limit: int | None) -> str:
    return "unlimited" if limit is None else f"{limit // 1024} KiB"


def judge_host(host: str, facts: dict, *, gpu: bool, multi_node: bool, floors: Floors) -> tuple[list[str], list[str]]:
    """(problems, warnings) of one node's ``host_facts``, each naming the node, the check, the
    measured value and the floor."""
    problems, warnings = [], []
    if multi_node and gpu and facts["infiniband"] and facts["memlock"] is not None:
        problems.append(f"{host}: ulimit -l (locked memory) is {_kib(facts['memlock'])}, NCCL over InfiniBand/RoCE "
                        f"needs unlimited (raise the hard memlock limit for the job: limits.conf, the slurmd unit's "
                        f"LimitMEMLOCK, or a container's --ulimit memlock=-1)")
    if floors.nofile and facts["nofile"] is not None and facts["nofile"] < floors.nofile:
        problems.append(f"{host}: ulimit -n (open files) is {facts['nofile']}, below the floor {floors.nofile} "
                        f"(--min-nofile); raise it with `ulimit -n` (hard limit permitting)")
    shm_floor = floors.shm_gib if gpu else min(floors.shm_gib, 1.0)
    if shm_floor and facts["shm_gib"] is not None and facts["shm_gib"] < shm_floor:
        problems.append(f"{host}: /dev/shm is {facts['shm_gib']:.1f} GiB, below the floor {shm_floor:g} GiB "
                        f"(--min-shm-gib): Ray's object store and the weight-sync buffers live there "
                        f"(containers: --shm-size)")
    if not gpu:
        return problems, warnings
    smi = facts.get("nvidia_smi")
    if isinstance(smi, str):
        problems.append(f"{host}: {smi}")
    else:
        problems += [f"{host}: {line}" for line in gpu_health_problems(smi["gpus"])]
        major = int(str(facts.get("cuda") or "0").split(".")[0])
        floor = floors.min_driver or MIN_DRIVER_FOR_CUDA.get(major)
        if smi["driver"] and floor and not driver_at_least(smi["driver"], floor):
            problems.append(f"{host}: NVIDIA driver {smi['driver']} is older than {floor} (--min-driver; "
                            f"torch's CUDA {facts.get('cuda')} needs it)")
    xids = facts.get("xids")
    if isinstance(xids, str):
        warnings.append(f"{host}: XID check skipped: {xids}")
    else:
        hardware = [line for _, xid, line in xids if xid in HARDWARE_XIDS]
        if hardware:
            warnings.append(f"{host}: {len(hardware)} hardware XID line(s) in the kernel log since boot, last: "
                            f"{hardware[-1]}")
    return problems, warnings
