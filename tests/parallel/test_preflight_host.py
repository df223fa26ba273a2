"""parallel/preflight_host.py and the preflight's verdict, without a GPU: the parsers read the
tools' own output formats (``nvidia-smi -q``, the kernel's NVRM XID lines, NCCL's INFO channel
lines: samples below in those formats, values chosen per test), and the judgements name the node,
the check, the measured value and the floor."""

from __future__ import annotations

import pytest

from parallel.preflight import judge_outcomes
from parallel.preflight_host import (
    Floors,
    bus_bandwidth_gb_s,
    driver_at_least,
    gpu_health_problems,
    judge_host,
    nccl_net_transports,
    parse_nvidia_smi_q,
    parse_xids,
)

# `nvidia-smi -q` of a two-GPU H100 node (R580 layout, sections trimmed): GPU 1 has a pending
# row remap and volatile uncorrectable DRAM errors.
NVIDIA_SMI_Q = """
==============NVSMI LOG==============

Timestamp                                              : Tue Mar 10 09:12:44 2026
Driver Version                                         : 580.82.07
CUDA Version                                           : 13.0

Attached GPUs                                          : 2
GPU 00000000:18:00.0
    Product Name                                       : NVIDIA H100 80GB HBM3
    GPU Reset Status
        Reset Required                                 : No
        Drain and Reset Recommended                    : No
    ECC Mode
        Current                                        : Enabled
        Pending                                        : Enabled
    ECC Errors
        Volatile
            SRAM Correctable                           : 0
            SRAM Uncorrectable Parity                  : 0
            SRAM Uncorrectable SEC-DED                 : 0
            DRAM Correctable                           : 3
            DRAM Uncorrectable                         : 0
        Aggregate
            SRAM Correctable                           : 0
            SRAM Uncorrectable Parity                  : 0
            SRAM Uncorrectable SEC-DED                 : 0
            DRAM Correctable                           : 12
            DRAM Uncorrectable                         : 1
    Retired Pages
        Single Bit ECC                                 : N/A
        Double Bit ECC                                 : N/A
        Pending Page Blacklist                         : N/A
    Remapped Rows
        Correctable Error                              : 0
        Uncorrectable Error                            : 1
        Pending                                        : No
        Remapping Failure Occurred                     : No
        Bank Remap Availability Histogram
            Max                                        : 2559 bank(s)
            High                                       : 1 bank(s)
            Partial                                    : 0 bank(s)
            Low                                        : 0 bank(s)
            None                                       : 0 bank(s)
    Processes                                          : None

GPU 00000000:2A:00.0
    Product Name                                       : NVIDIA H100 80GB HBM3
    GPU Reset Status
        Reset Required                                 : No
        Drain and Reset Recommended                    : No
    ECC Errors
        Volatile
            SRAM Correctable                           : 0
            SRAM Uncorrectable Parity                  : 0
            SRAM Uncorrectable SEC-DED                 : 0
            DRAM Correctable                           : 0
            DRAM Uncorrectable                         : 2
        Aggregate
            SRAM Correctable                           : 0
            SRAM Uncorrectable Parity                  : 0
            SRAM Uncorrectable SEC-DED                 : 0
            DRAM Correctable                           : 0
            DRAM Uncorrectable                         : 2
    Retired Pages
        Single Bit ECC                                 : N/A
        Double Bit ECC                                 : N/A
        Pending Page Blacklist                         : N/A
    Remapped Rows
        Correctable Error                              : 0
        Uncorrectable Error                            : 2
        Pending                                        : Yes
        Remapping Failure Occurred                     : No
    Processes                                          : None
"""

# The older layout (Volta and earlier drivers): per-unit counts and a total, page retirement.
NVIDIA_SMI_Q_OLD = """
Driver Version                            : 470.256.02

Attached GPUs                             : 1
GPU 00000000:00:1E.0
    ECC Errors
        Volatile
            Single Bit
                Device Memory             : 0
                Total                     : 0
            Double Bit
                Device Memory             : 1
                Register File             : 0
                Total                     : 1
    Retired Pages
        Single Bit ECC                    : 0
        Double Bit ECC                    : 1
        Pending Page Blacklist            : Yes
"""

KERNEL_LOG = """\
[ 1021.334120] NVRM: GPU at PCI:0000:2a:00: GPU-5c1e3b1a-7c1f-4d3e-9a0b-1e2f3a4b5c6d
[ 1021.334125] NVRM: Xid (PCI:0000:2a:00): 79, pid=1911, name=python, GPU has fallen off the bus.
[ 1500.000001] NVRM: Xid (PCI:0000:18:00): 13, pid=2201, name=python, Graphics SM Warp Exception on (GPC 0, TPC 1)
"""

IB_LOG = """\
n1:4962:4975 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB ib0:10.1.0.1<0>
n1:4962:4975 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
n1:4962:4975 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [receive] via NET/IB/0/GDRDMA
n1:4962:4975 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA
"""
SOCKET_LOG = """\
n2:5425:5439 [0] NCCL INFO NET/IB : No device found.
n2:5425:5439 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.2<0>
n2:5425:5439 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [receive] via NET/Socket/0
n2:5425:5439 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [send] via NET/Socket/0
"""


def test_bus_bandwidth_is_nccl_tests_formula():
    # 1 GiB in 10 ms over 8 ranks: algbw 107.37 GB/s x 2*7/8
    assert bus_bandwidth_gb_s(1 << 30, 0.01, 8) == pytest.approx(107.3741824 * 1.75)
    assert bus_bandwidth_gb_s(1 << 30, 0.01, 1) == 0.0


def test_nvidia_smi_q_is_parsed_per_gpu_and_unfit_gpus_named():
    parsed = parse_nvidia_smi_q(NVIDIA_SMI_Q)
    assert parsed["driver"] == "580.82.07"
    assert list(parsed["gpus"]) == ["00000000:18:00.0", "00000000:2A:00.0"]
    first = parsed["gpus"]["00000000:18:00.0"]
    assert first["ECC Errors/Aggregate/DRAM Uncorrectable"] == "1"
    assert first["Remapped Rows/Bank Remap Availability Histogram/Max"] == "2559 bank(s)"
    assert first["Remapped Rows/Pending"] == "No" and first["Processes"] == "None"
    problems = gpu_health_problems(parsed["gpus"])
    # GPU 0: only aggregate (lifetime) errors, already remapped: fit. GPU 1: both faults.
    assert problems == [
        "GPU 00000000:2A:00.0: 2 uncorrectable ECC error(s) since the driver loaded (nvidia-smi -q: ECC Errors/Volatile)",
        "GPU 00000000:2A:00.0: row remapping pending (nvidia-smi -q: Remapped Rows/Pending: Yes); "
        "the GPU needs a reset or service"]


def test_older_nvidia_smi_layout_counts_the_total_once():
    parsed = parse_nvidia_smi_q(NVIDIA_SMI_Q_OLD)
    assert parsed["driver"] == "470.256.02"
    assert gpu_health_problems(parsed["gpus"]) == [
        "GPU 00000000:00:1E.0: 1 uncorrectable ECC error(s) since the driver loaded (nvidia-smi -q: ECC Errors/Volatile)",
        "GPU 00000000:00:1E.0: pages pending retirement (nvidia-smi -q: Retired Pages/Pending Page Blacklist: Yes); "
        "the GPU needs a reset or service"]


def test_xids_and_nccl_transports_are_read_from_their_log_lines():
    assert [(bus, xid) for bus, xid, _ in parse_xids(KERNEL_LOG)] == [("0000:2a:00", 79), ("0000:18:00", 13)]
    assert list(nccl_net_transports(IB_LOG)) == ["IB"]
    assert nccl_net_transports(SOCKET_LOG) == {"Socket": "n2:5425:5439 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] "
                                                         "[receive] via NET/Socket/0"}
    assert nccl_net_transports("n1:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read") == {}


def test_driver_versions_compare_numerically():
    assert driver_at_least("580.65.06", "580.65.06") and driver_at_least("580.105.08", "580.65.06")
    assert not driver_at_least("575.57.08", "580.65.06") and not driver_at_least("580.9.1", "580.65.06")


def _facts(**over) -> dict:
    facts = {"memlock": None, "nofile": 65535, "infiniband": ["rdma_cm", "uverbs0"], "shm_gib": 500.0,
             "cuda": "13.0", "nvidia_smi": parse_nvidia_smi_q(NVIDIA_SMI_Q_OLD.replace(": Yes", ": No")
                                                               .replace(": 1\n", ": 0\n").replace("470.256.02", "580.82.07")),
             "xids": parse_xids(KERNEL_LOG)}
    facts.update(over)
    return facts


def test_host_judgement_names_node_check_value_and_floor():
    problems, warnings = judge_host("gpu-07", _facts(), gpu=True, multi_node=True, floors=Floors())
    assert problems == [] and len(warnings) == 1 and "gpu-07: 1 hardware XID line(s)" in warnings[0], warnings
    bad = _facts(memlock=64 * 1024, nofile=1024, shm_gib=0.0625,
                 nvidia_smi=parse_nvidia_smi_q(NVIDIA_SMI_Q.replace("580.82.07", "575.57.08")))
    problems, _ = judge_host("gpu-07", bad, gpu=True, multi_node=True, floors=Floors())
    text = "\n".join(problems)
    assert "gpu-07: ulimit -l (locked memory) is 64 KiB, NCCL over InfiniBand/RoCE needs unlimited" in text
    assert "gpu-07: ulimit -n (open files) is 1024, below the floor 8192 (--min-nofile)" in text
    assert "gpu-07: /dev/shm is 0.1 GiB, below the floor 64 GiB (--min-shm-gib)" in text
    assert "gpu-07: NVIDIA driver 575.57.08 is older than 580.65.06 (--min-driver; torch's CUDA 13.0 needs it)" in text
    assert "gpu-07: GPU 00000000:2A:00.0: row remapping pending" in text
    # memlock matters only to RDMA between nodes; a CPU node gets a 1 GiB /dev/shm floor at most.
    problems, _ = judge_host("cpu-01", _facts(memlock=64 * 1024, shm_gib=2.0), gpu=False, multi_node=True,
                             floors=Floors())
    assert problems == []


def _report(rank: int, host: str) -> dict:
    return {"rank": rank, "host": host, "gpus_visible": 8, "gpus_expected": 8, "cuda_visible_devices": None,
            "problems": [], "facts": _facts()}


def _outcome(host: str, log: str, intra_s: float, inter_s: float) -> dict:
    return {"host": host, "problems": [], "intra_s": intra_s, "inter_s": inter_s, "transports": nccl_net_transports(log)}


GO = {"backend": "nccl", "counts": [8, 8], "nbytes": 1 << 30, "iters": 10, "warmup": 3}


def test_verdict_judges_bandwidth_floors_and_a_socket_fallback_by_node():
    reports = [_report(0, "gpu-01"), _report(1, "gpu-02")]
    # gpu-01: 1 GiB in 4 ms among 8 GPUs (469.8 GB/s); gpu-02 in 40 ms (47.0 GB/s, below 150).
    # All 16 ranks: 40 ms -> 1 GiB / 0.04 s x 30/16 = 50.3 GB/s, above 40; gpu-02 went over sockets.
    outcomes = {0: _outcome("gpu-01", IB_LOG, 0.004, 0.04), 1: _outcome("gpu-02", SOCKET_LOG, 0.04, 0.03)}
    result = judge_outcomes(GO, reports, outcomes, [], Floors(), None, 60)
    assert not result.ok
    assert [round(m["bus_gb_s"], 1) for m in result.intra] == [469.8, 47.0]
    assert result.inter["bus_gb_s"] == pytest.approx(bus_bandwidth_gb_s(1 << 30, 0.04, 16))
    assert result.problems[0] == ("gpu-02: intra-node all_reduce over its 8 GPUs: bus bandwidth 47.0 GB/s, below the "
                                  "floor 150 GB/s (--intra-node-floor-gb-s)")
    assert result.problems[1].startswith("gpu-02: NCCL runs between nodes over sockets, not RDMA (NCCL INFO: "
                                         "'n2:5425:5439 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [receive] via "
                                         "NET/Socket/0'); /dev/infiniband: rdma_cm uverbs0, ulimit -l: unlimited")
    assert len(result.problems) == 2, result.problems
    assert [t["net"] for t in result.transports] == [["IB"], ["Socket"]]
    # An Ethernet-only cluster accepts sockets: a warning; a floor above the measured inter-node rate fails.
    lenient = Floors(intra_node_gb_s=40, inter_node_gb_s=60, allow_nccl_socket=True)
    result = judge_outcomes(GO, reports, outcomes, [], lenient, None, 60)
    assert result.problems == ["inter-node all_reduce over gpu-01, gpu-02 (16 ranks): bus bandwidth 50.3 GB/s, below "
                               "the floor 60 GB/s (--inter-node-floor-gb-s); the transport lines name each node's network"]
    assert any(w.startswith("gpu-02: NCCL runs between nodes over sockets") for w in result.warnings)


def test_verdict_on_gloo_has_no_bandwidth_floor_and_no_transport_check():
    reports = [dict(_report(r, h), gpus_visible=0, gpus_expected=0, facts=_facts(infiniband=[], memlock=8 << 20))
               for r, h in enumerate(("cpu-01", "cpu-02"))]
    go = dict(GO, backend="gloo", counts=[1, 1], nbytes=1 << 22)
    outcomes = {r: _outcome(h, "", None, 10.0) for r, h in enumerate(("cpu-01", "cpu-02"))}
    result = judge_outcomes(go, reports, outcomes, [], Floors(), None, 60)
    assert result.ok and result.inter["bus_gb_s"] < 0.01 and result.transports == [], result.problems
