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


def _is_resource_tracker(proc: psutil.Process) -> bool:
    try:
        return "multiprocessing.resource_tracker" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def live_descendants() -> list[psutil.Process]:
    """Live descendants of this test process, except Python's own multiprocessing resource
    tracker (one per interpreter, started by the first spawn, exits with the interpreter)."""
    return [p for p in live(psutil.Process().children(recursive=True)) if not _is_resource_tracker(p)]
