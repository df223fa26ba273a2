"""CPU Megatron workers reuse freed activation memory instead of faulting it in again.

Oracle: the kernel's count of minor page faults (``getrusage``). In a fresh process, a 64 MiB
and a 16 MiB tensor are made and freed five times, as a training step's activations are; the
fifth round costs ~20k faults (80 MiB / 4 KiB pages) under glibc's defaults (the control, which
shows the count can fail) and none once the heap has settled after ``keep_freed_host_memory()``
(the first rounds still fault: 64-byte-aligned blocks do not fit exactly into freed ones).
"""

import subprocess
import sys

import pytest

PROBE = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from megarl.workers.megatron_worker import keep_freed_host_memory
    assert keep_freed_host_memory()
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(16 << 20); y = torch.ones(4 << 20); del x, y
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_of_fifth_round(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tunables")
def test_freed_activation_memory_is_reused_without_page_faults():
    pages = (80 << 20) // 4096
    assert faults_of_fifth_round("default") > pages // 2
    assert faults_of_fifth_round("keep") < pages // 20
