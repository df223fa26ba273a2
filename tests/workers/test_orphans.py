"""megatron's checkpoint writer keeps a multiprocessing Manager server per process; a worker that
Ray SIGKILLs must not leave it behind (megarl/workers/orphans.py)."""

import os
import signal
import subprocess
import sys
import time

import psutil

CHILD = """
import sys
from megarl.workers.orphans import checkpoint_results_queue_dies_with_this_process
from megatron.core.dist_checkpointing.strategies import filesystem_async

checkpoint_results_queue_dies_with_this_process()
queue = filesystem_async._get_write_results_queue()  # what megatron's writer asks for: ours
queue.put("ok")
assert queue.get() == "ok"
print("ready", flush=True)
sys.stdin.read()
"""


def test_checkpoint_results_manager_exits_when_its_worker_is_sigkilled():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        helpers = psutil.Process(proc.pid).children(recursive=True)
        assert any("spawn_main" in " ".join(p.cmdline()) for p in helpers), helpers  # the Manager server
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(helpers, timeout=15)
        assert alive == [], f"left behind: {[' '.join(p.cmdline()) for p in alive]}"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
