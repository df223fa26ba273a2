"""`megarl preflight` without Slurm: ranks as local processes (tests/launch_scripts runs it under srun).

- two ranks: the collective runs, the verdict is OK on both, with a bandwidth figure;
- a rank that never joins: rank 0 fails within a bounded time and names the missing rank's host;
- a rank whose rank 0 never comes up: it fails within a bounded time naming rank 0's address;
- a node that sees fewer GPUs than the job expects: the verdict names it.
"""

import subprocess
import sys
import time
from pathlib import Path

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
