"""A real two-node Slurm cluster (ci/slurm_up.sh) for the tests in this directory.

``slurm_cluster`` (session): brings the cluster up once and yields the environment Slurm clients
need ({"SLURM_CONF": ...}). If Slurm cannot start, every test using it fails with slurm_up.sh's
output: nothing is skipped silently. The cluster is stopped (ci/slurm_down.sh) at the end of the
session only if this session started it and no other live test session on this host still uses
it (each session holds a lease file, <state dir>/leases/<pid>); one that was already up (started
by hand or by another session) is left running for its owner.

``job_processes(job)`` / ``job_leftovers(job)``: the live processes a job started, found by
SLURM_JOB_ID=<job> in /proc/<pid>/environ (inherited by everything a job starts: job steps, Ray's
daemons and workers); every test that submits a job asserts ``job_leftovers(job) == []`` after it.
Both "nodes" are this host, so one /proc shows the processes of n1 and n2 (SLURMD_NODENAME tells
which). ``kill_slurmd(node)`` / ``restart_slurmd(node, env)``: a node's slurmd dies (its job steps
keep running, as on a real node) and comes back, recorded in <state dir>/pids as slurm_up.sh does.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
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


_GROUPS: dict[str, dict[int, str]] = {}  # job -> process groups its processes were seen in -> node


def job_processes(job: str) -> list[tuple[int, str, str]]:
    """(pid, command line, node) of every live process carrying SLURM_JOB_ID=<job> in its environment,
    and of the other members of the process groups such processes were seen in (by any call for
    this job): Ray's agents overwrite their environment with their process title, and a process
    group id is not reused while the group has members, so an orphaned agent is still found."""
    groups = _GROUPS.setdefault(job, {})
    found: dict[int, tuple[int, str, str]] = {}
    others = []
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            environ = proc.environ()
            if environ.get("SLURM_JOB_ID") == job:
                node = environ.get("SLURMD_NODENAME", "?")
                found[proc.pid] = (proc.pid, " ".join(proc.cmdline()), node)
                groups.setdefault(os.getpgid(proc.pid), node)
            else:
                others.append(proc)
        except (psutil.Error, OSError):
            pass
    for proc in others:
        try:
            group = os.getpgid(proc.pid)
            if group in groups:
                found[proc.pid] = (proc.pid, " ".join(proc.cmdline()), groups[group])
        except (psutil.Error, OSError):
            pass
    return list(found.values())


def job_leftovers(job: str, timeout_s: float = 30) -> list[tuple[int, str, str]]:
    """The job's processes still running after up to ``timeout_s`` (a finished job's steps may
    take a moment to end); ``[]`` when none is left."""
    deadline = time.monotonic() + timeout_s
    while (left := job_processes(job)) and time.monotonic() < deadline:
        time.sleep(1)
    return left


def _pids_file() -> dict[str, int]:
    entries = (line.split() for line in (STATE_DIR / "pids").read_text().splitlines() if line.strip())
    return {name: int(pid) for name, pid in entries}


def kill_slurmd(node: str) -> int:
    """SIGKILL the slurmd of ``node`` (as recorded by slurm_up.sh); its slurmstepds and their
    processes keep running. Returns the pid it killed."""
    pid = _pids_file()[f"slurmd-{node}"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pid


def restart_slurmd(node: str, env: dict, timeout_s: float = 90) -> None:
    """Start ``node``'s slurmd again the way slurm_up.sh does (own UTS namespace and hostname),
    record it in <state dir>/pids (slurm_down.sh stops it), and wait until the node is usable."""
    conf = STATE_DIR / "slurm.conf"
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 1))
    with open(f"{str(STATE_DIR).rstrip('/')}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # slurm_up.sh / slurm_down.sh hold it while they run
        pids = _pids_file()
        if not _alive(pids[f"slurmd-{node}"]):
            out = subprocess.run(
                ["bash", "-c", f"setsid unshare --uts sh -c \"hostname {node} && exec slurmd -D -N {node} -f '{conf}'\" "
                 f"</dev/null >>'{STATE_DIR}/log/slurmd-{node}.out' 2>&1 & echo $!"],
                capture_output=True, text=True, check=True, env={**os.environ, "SLURM_CONF": str(conf)}).stdout
            pids[f"slurmd-{node}"] = int(out.split()[-1])
            (STATE_DIR / "pids").write_text("".join(f"{name} {pid}\n" for name, pid in pids.items()))
    # Usable: the controller has heard from the new slurmd (SlurmdStartTime) and the node is up.
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(["scontrol", "show", "node", node], env=env, capture_output=True, text=True).stdout
        info = dict(re.findall(r"(\w+)=(\S*)", out))
        state = info.get("State", "?")
        if info.get("SlurmdStartTime", "") >= since and state in ("IDLE", "ALLOCATED", "MIXED"):
            return  # (not +COMPLETING: the jobs it was part of have finished on it)
        if any(word in state for word in ("DOWN", "DRAIN")):
            subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], env=env, capture_output=True)
        if time.monotonic() > deadline:
            raise AssertionError(f"slurmd of {node} restarted, but the node is {state} after {timeout_s:.0f} s:\n{out}")
        time.sleep(0.5)
