"""Process accounting for the no-process-left-behind assertions."""

import psutil


def live(procs) -> list[psutil.Process]:
    """The processes of ``procs`` that still run (zombies and vanished ones excluded)."""
    alive = []
    for proc in procs:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.Error:
            pass
    return alive


def _is_per_interpreter_helper(proc: psutil.Process) -> bool:
    """Python's multiprocessing resource tracker and fork server (``run_on_ranks`` starts ranks
    from it) and torch's shared-memory manager: one per interpreter that uses them, exiting with
    it (the manager: when its last client disconnects). An SGLang engine handle in this process
    starts the manager with its first weight update."""
    try:
        cmdline = " ".join(proc.cmdline())
        return (proc.name() == "torch_shm_manager" or "multiprocessing.resource_tracker" in cmdline
                or "multiprocessing.forkserver" in cmdline)
    except psutil.Error:
        return False


def live_descendants() -> list[psutil.Process]:
    """Live descendants of this test process, except the per-interpreter helpers above."""
    return [p for p in live(psutil.Process().children(recursive=True)) if not _is_per_interpreter_helper(p)]
