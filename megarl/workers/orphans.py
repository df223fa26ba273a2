"""Helper processes that must not outlive a worker killed with SIGKILL.

Ray SIGKILLs the workers of a driver that died once its grace period is over, and a SIGKILLed
process runs no finalizers. megatron's checkpoint writer keeps one multiprocessing Manager server
per process for its results queue (``filesystem_async._get_write_results_queue``, a spawned
``python`` that otherwise lives until its parent exits cleanly): this module creates that queue
first, on a Manager whose server process exits as soon as its parent is gone.

Imports nothing heavy: the spawned server imports this module.
"""

from __future__ import annotations

import os
import threading
import time


def exit_when_parent_dies(poll_s: float = 1.0) -> None:
    """In the calling process: a daemon thread that exits the process once its parent is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="exit-when-parent-dies", daemon=True).start()


def checkpoint_results_queue_dies_with_this_process() -> None:
    """Give megatron's checkpoint writer its results queue now, served by a Manager that exits
    with this process (idempotent; call before the first ``dist_checkpointing.save``)."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=exit_when_parent_dies)
    filesystem_async._results_queue = manager.Queue()
    filesystem_async._megarl_results_manager = manager  # keeps the server up as long as the queue
