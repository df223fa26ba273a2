"""Run one function on N torch.distributed ranks (gloo on CPU; on GPUs NCCL for CUDA tensors, gloo
for CPU ones) as local processes.

Used by the tests and by tools that run N ranks on one machine. Each rank is a fresh process
(forked by a preloaded fork server without CUDA, spawned with it) in its own process group (so
helpers it starts, e.g. the dist-checkpoint writer, die with it); results come back over a pipe;
the first failing rank's traceback is re-raised in the caller; a timeout kills every rank;
nothing is left running when ``run_on_ranks`` returns or raises.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable


class RankFailedError(RuntimeError):
    """A rank raised; the message carries its traceback."""


class RanksTimedOutError(TimeoutError):
    """Some ranks did not finish in time; they were killed."""


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def threads_per_rank(world_size: int) -> int:
    """Intra-op threads per rank so N ranks never oversubscribe the cores (a 19x slowdown here)."""
    return max(1, (os.cpu_count() or 1) // world_size)


# Imported once by the fork server of a machine without CUDA, inherited by every rank it forks.
FORKSERVER_PRELOAD = ["torch", "megatron.core", "megatron.core.models.gpt", "parallel.cpu.compat"]


def _context() -> mp.context.BaseContext:
    """How ranks start. Without CUDA: forked by a fork server that imported torch and megatron
    once, so a rank starts at once instead of importing them again (about 9 s of CPU per rank on
    a 2-core machine). With CUDA: spawned, because a process that may have touched the driver
    must not be forked. A missing preload module (no megatron) is skipped by the server."""
    import torch

    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def _rank_main(fn, args, kwargs, rank, world_size, port, env, conn, init_distributed):
    os.setpgrp()  # own process group: the parent can kill this rank and everything it started
    os.environ.clear()  # the caller's environment now, not the fork server's from its start
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    try:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        if init_distributed:
            import torch.distributed as dist

            from parallel.cpu import compat as cpu_compat
            from parallel.process_groups import distributed_backend

            cpu_mode = cpu_compat.apply()
            if not cpu_mode:  # one GPU per rank (local rank = rank), before NCCL picks the current device
                torch.cuda.set_device(rank % torch.cuda.device_count())
            dist.init_process_group(
                backend=distributed_backend(cuda_available=not cpu_mode), init_method=f"tcp://127.0.0.1:{port}",
                rank=rank, world_size=world_size, timeout=timedelta(seconds=float(env.get("MEGARL_DIST_TIMEOUT_S", 120))),
            )
        result = fn(*args, **kwargs)
        # Plain pickle, not multiprocessing's: that one passes tensors as shared-memory handles
        # served by this process, which may have exited by the time the parent reads them.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        conn.close()
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown must not mask the result
            pass


def _kill_group(proc: mp.Process) -> None:
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.join(timeout=10)


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    init_distributed: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return the per-rank results.

    ``fn`` must be importable (a module-level function). When ``init_distributed`` is set, each
    rank applies the megatron CPU compatibility layer (CPU only) and joins a fresh process group.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    ctx = _context()
    port = free_port()
    rank_env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank(world_size)), **(env or {})}
    procs, conns = [], []
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main, args=(fn, args, kwargs, rank, world_size, port, rank_env, send, init_distributed),
                name=f"megarl-rank{rank}", daemon=False,
            )
            proc.start()
            send.close()
            procs.append(proc)
            conns.append(recv)
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        pending = {conn: rank for rank, conn in enumerate(conns)}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RanksTimedOutError(
                    f"ranks {sorted(pending.values())} of {world_size} did not finish within {timeout_s:.0f} s "
                    f"(running {getattr(fn, '__qualname__', fn)}); all ranks were killed"
                )
            for conn in mp.connection.wait(list(pending), timeout=min(remaining, 1.0)):
                rank = pending.pop(conn)
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                except EOFError:
                    procs[rank].join(5)
                    raise RankFailedError(
                        f"rank {rank} died without a result (exit code {procs[rank].exitcode})"
                    ) from None
                if status == "error":
                    raise RankFailedError(f"rank {rank} of {world_size} failed:\n{payload}")
                results[rank] = payload
        for proc in procs:
            proc.join(timeout=30)
        return [results[rank] for rank in range(world_size)]
    finally:
        for proc in procs:
            _kill_group(proc)
        for conn in conns:
            conn.close()
