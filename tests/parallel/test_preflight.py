"""`megarl preflight` without Slurm: ranks as local processes (tests/launch_scripts runs it under srun).

- two ranks: the collective runs, the verdict is OK on both, with a bandwidth figure;
- a rank that never joins: rank 0 fails within a bounded time and names the missing rank's host;
- a rank whose rank 0 never comes up: it fails within a bounded time naming rank 0's address;
- a node that sees fewer GPUs than the job expects: the verdict names it;
- two ranks per node: an all_reduce within each node and over all ranks, whose printed bus
  bandwidth is nccl-tests' formula of the printed time; a host check below its floor is named.
"""

import re
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallel.spawn import free_port

ROOT = Path(__file__).resolve().parents[2]
PREFLIGHT = [sys.executable, "-m", "megarl.cli", "preflight"]


def _start(*args):
    return subprocess.Popen(PREFLIGHT + [str(a) for a in args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(proc, timeout_s=60):
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        proc.kill()
    return proc.returncode, out


def test_two_ranks_pass():
    port = free_port()
    common = ["--world-size", 2, "--master-addr", "127.0.0.1", "--master-port", port, "--hosts", "node-a,node-b",
              "--gpus-per-node", 0, "--timeout", 30]
    procs = [_start("--rank", r, *common) for r in (0, 1)]
    (code0, out0), (code1, out1) = [_finish(p) for p in procs]
    assert code0 == 0 and code1 == 0, out0 + out1
    assert "backend gloo: OK" in out0 and "all_reduce ok" in out0 and "GB/s" in out0, out0
    assert "rank 1" in out0, out0


def test_a_rank_that_never_joins_is_named_within_the_timeout():
    start = time.monotonic()
    code, out = _finish(_start("--rank", 0, "--world-size", 3, "--master-addr", "127.0.0.1", "--master-port",
                               free_port(), "--hosts", "node-a,node-b,node-c", "--timeout", 4))
    elapsed = time.monotonic() - start
    assert code == 1, out
    assert "never joined" in out and "rank 1 (node-b)" in out and "rank 2 (node-c)" in out, out
    assert elapsed < 30, elapsed


def test_a_rank_without_rank_0_names_the_rendezvous():
    start = time.monotonic()
    port = free_port()
    code, out = _finish(_start("--rank", 1, "--world-size", 2, "--master-addr", "127.0.0.1", "--master-port", port,
                               "--hosts", "node-a,node-b", "--timeout", 3))
    assert code == 1, out
    assert f"cannot reach the rendezvous of rank 0 at 127.0.0.1:{port} on node-a" in out, out
    assert time.monotonic() - start < 30


def test_a_node_with_the_wrong_gpu_count_is_named():
    code, out = _finish(_start("--rank", 0, "--world-size", 1, "--master-addr", "127.0.0.1", "--master-port",
                               free_port(), "--gpus-per-node", 8, "--timeout", 20))
    assert code == 1, out
    assert "0 GPU(s) visible, expected 8" in out and "FAILED" in out, out


def _preflight_pair(*extra, ranks_per_node=2):
    port = free_port()
    common = ["--world-size", 2, "--master-addr", "127.0.0.1", "--master-port", port, "--hosts", "node-a,node-b",
              "--gpus-per-node", 0, "--timeout", 60, "--ranks-per-node", ranks_per_node, *extra]
    procs = [_start("--rank", r, *common) for r in (0, 1)]
    return [_finish(p, timeout_s=120) for p in procs]


def test_ranks_per_node_run_intra_and_inter_node_all_reduce_with_nccl_tests_bus_bandwidth():
    (code0, out0), (code1, out1) = _preflight_pair("--bytes", 1 << 20, "--iters", 4)
    assert code0 == 0 and code1 == 0, out0 + out1
    intra = re.findall(r"intra-node all_reduce ok on rank (\d) \S+ \((\d) ranks\): 1 MiB x 4, ([\d.]+) ms, "
                       r"bus bandwidth ([\d.]+) GB/s", out0)
    inter = re.search(r"inter-node all_reduce ok over 2 node\(s\), 4 ranks: 1 MiB x 4, ([\d.]+) ms, "
                      r"bus bandwidth ([\d.]+) GB/s", out0)
    assert [(r, n) for r, n, _, _ in intra] == [("0", "2"), ("1", "2")] and inter, out0
    # nccl-tests: busbw = bytes / time x 2(n-1)/n (printed rounded to 0.01)
    for n, ms, bus in [(2, float(ms), float(bus)) for _, _, ms, bus in intra] + [(4, *map(float, inter.groups()))]:
        assert bus == pytest.approx((1 << 20) / (ms / 1e3) * 2 * (n - 1) / n / 1e9, rel=0.02, abs=0.01), out0
    assert "2 rank(s); ulimit -l" in out0 and "/dev/shm" in out0, out0


def test_a_host_check_below_its_floor_names_node_value_and_floor():
    (code0, out0), _ = _preflight_pair("--min-nofile", 1 << 30, ranks_per_node=1)
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert code0 == 1, out0
    assert f"ERROR: {socket.gethostname()}: ulimit -n (open files) is {nofile}, below the floor {1 << 30}" in out0, out0
    assert "backend gloo: FAILED" in out0 and "inter-node all_reduce ok" in out0, out0  # the collective still ran
