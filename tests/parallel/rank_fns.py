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


def cpu_collectives_rank(backend):
    """Join a group on ``backend`` (env:// from run_on_ranks) and run every collective kind the code
    runs on CPU tensors: all_reduce (float64, the DP loss and checks), isend/irecv pairs (the reshard
    executor), send/recv (gather_hf_tensors), broadcast_object_list, all_gather_object, gather_object."""
    dist.init_process_group(backend=backend, init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([rank + 0.5], dtype=torch.float64)
    dist.all_reduce(total)
    peer = 1 - rank
    outgoing, incoming = torch.full((3,), float(rank)), torch.empty(3)
    works = [dist.isend(outgoing, dst=peer), dist.irecv(incoming, src=peer)] if rank == 0 else \
        [dist.irecv(incoming, src=peer), dist.isend(outgoing, dst=peer)]
    for work in works:
        work.wait()
    sent = torch.arange(4, dtype=torch.bfloat16)
    if rank == 1:
        dist.send(sent, dst=0)
        received = None
    else:
        received = torch.empty(4, dtype=torch.bfloat16)
        dist.recv(received, src=1)
    shared = [{"from": rank}] if rank == world - 1 else [None]
    dist.broadcast_object_list(shared, src=world - 1)
    everyone = [None] * world
    dist.all_gather_object(everyone, {"rank": rank})
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(rank * 10, gathered, dst=0)
    return {"backend": str(dist.get_backend()), "all_reduce": total.item(), "dtype": str(total.dtype),
            "received": incoming.tolist(), "sent_recv": None if received is None else received.float().tolist(),
            "broadcast": shared[0], "all_gather": everyone, "gather": gathered}


def megatron_worker_env_rank():
    """Construct a MegatronWorker that joins the group itself (as under Ray); report its env."""
    from megarl.workers.megatron_worker import MegatronWorker

    os.environ.pop("LOCAL_RANK", None)  # run_on_ranks sets it; a Ray actor has none
    worker = MegatronWorker(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            master_port=int(os.environ["MASTER_PORT"]), timeout_s=60)
    probe = torch.tensor([1.0], dtype=torch.float64)
    dist.all_reduce(probe)
    return {"rank": worker.rank, "local_rank": os.environ.get("LOCAL_RANK"), "backend": str(dist.get_backend()),
            "sum": probe.item()}
