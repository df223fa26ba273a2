"""Functions that run on each rank of a multi-process test here (``parallel.spawn.run_on_ranks``
imports them by module path in every rank)."""

import os
import subprocess
import time

import torch
import torch.distributed as dist


def all_reduce_rank(scale):
    """Sum of (rank+1)*scale over all ranks, plus who this rank is and the caller's marker variable."""
    value = torch.tensor([float(dist.get_rank() + 1) * scale])
    dist.all_reduce(value)
    return {"rank": dist.get_rank(), "sum": float(value), "threads": torch.get_num_threads(),
            "marker": os.environ.get("MEGARL_TEST_MARKER")}


def fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank one")
    dist.barrier()  # rank 0 waits for a peer that never comes: the harness must not hang
    return "unreachable"


def start_grandchild_then_hang(pid_file):
    """Start a helper process (like the dist-checkpoint writer), record its pid, then hang."""
    child = subprocess.Popen(["sleep", "600"])
    with open(f"{pid_file}.{os.getpid()}", "w") as handle:
        handle.write(str(child.pid))
    time.sleep(600)
