"""A real two-node Slurm cluster (ci/slurm_up.sh) for the tests in this directory.

``slurm_cluster`` (session): brings the cluster up once and yields the environment Slurm clients
need ({"SLURM_CONF": ...}). If Slurm cannot start, every test using it fails with slurm_up.sh's
output: nothing is skipped silently. The cluster is stopped (ci/slurm_down.sh) at the end of the
session only if this session started it and no other live test session on this host still uses
it (each session holds a lease file, <state dir>/leases/<pid>); one that was already up (started
by hand or by another session) is left running for its owner.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STATE_DIR = Path(os.environ.get("MEGARL_SLURM_DIR", "/tmp/megarl-slurm"))


def _run(script: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "ci" / script)], capture_output=True, text=True, timeout=timeout_s)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@pytest.fixture(scope="session")
def slurm_cluster():
    try:
        up = _run("slurm_up.sh", timeout_s=300)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"ci/slurm_up.sh did not finish within 300 s:\n{error.stdout or ''}{error.stderr or ''}")
    if up.returncode != 0:
        pytest.fail(f"ci/slurm_up.sh failed (status {up.returncode}):\n{up.stdout}{up.stderr}")
    started_here = "already up" not in up.stdout
    leases = STATE_DIR / "leases"
    leases.mkdir(exist_ok=True)
    mine = leases / str(os.getpid())
    mine.touch()
    yield {"SLURM_CONF": str(STATE_DIR / "slurm.conf")}
    mine.unlink(missing_ok=True)
    others = [p for p in leases.iterdir() if p.name.isdigit() and _alive(int(p.name))]
    if started_here and not others:
        down = _run("slurm_down.sh", timeout_s=120)
        assert down.returncode == 0, f"ci/slurm_down.sh failed:\n{down.stdout}{down.stderr}"
