"""launch_scripts/ray_on_slurm.sh on a real two-node Slurm (tests/launch_scripts/conftest.py), with real Ray
and the real trainer (tiny, CPU):

a. a 2-node job trains: the Megatron workers run on both nodes (seen in the OS: the
   `ray::MegatronWorker` processes of the job carry n1's and n2's SLURMD_NODENAME, i.e. the raylet
   of each node started one); the pre-timeout signal makes it checkpoint, requeue itself, resume
   from the checkpoint and finish every step exactly once (COMPLETED), and nothing of the job is
   left running (one job for both: each costs two full job start-ups);
b. a node whose `ray start` fails, or never joins: the job fails within a bounded time and names
   the node;
c. a Ray node lost while the driver runs (its raylet killed): named, the driver asked to stop,
   the job fails and leaves nothing running.

Jobs are watched by polling `scontrol show job` (sbatch --wait polls slowly). Processes are
attributed to a job by SLURM_JOB_ID in their environment (inherited by everything a job starts,
Ray's daemons and workers included).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from parallel.spawn import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch_scripts" / "ray_on_slurm.sh"
VENV_BIN = Path(sys.executable).parent
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED"}
TRAIN = ["megarl", "train", "configs/quickstart_grpo.yaml"]


@pytest.fixture(scope="module")
def prompts(arith_prompts):
    return arith_prompts(64)


def _env(cluster: dict, **extra) -> dict:
    # Not inside another job; and no inherited MEGARL_VENV (ci/run_tests.sh users may set it): the
    # script would put its bin/ before the PATH a test sets up (e.g. a faulty `ray` on n2).
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "MEGARL_VENV"}
    env.update(cluster)
    env.update(PATH=f"{VENV_BIN}:{env['PATH']}", MEGARL_RAY_NUM_CPUS="1", MEGARL_GPUS_PER_NODE="0",
               RAY_PORT=str(free_port()), MEGARL_PREFLIGHT_PORT=str(free_port()), MEGARL_RAY_JOIN_TIMEOUT="120",
               MEGARL_PREFLIGHT_TIMEOUT="60", MEGARL_DRIVER_GRACE="180")
    env.update(extra)
    return env


def _train_args(prompts: str, out: Path, **overrides) -> list[str]:
    settings = {"data.train_files": f"[{prompts}]", "trainer.output_dir": str(out), "trainer.loggers": "[console]",
                "cluster.nodes": 2, "cluster.cpu_ranks_per_node": 1, "data.batch_size": 4, "rollout.n": 2,
                "rollout.max_new_tokens": 2, "actor.micro_batch_size": 4, "ref.micro_batch_size": 4,
                "trainer.total_steps": 2, "trainer.save_every": 0}
    settings.update(overrides)
    return TRAIN + [f"{k}={v}" for k, v in settings.items()] + ["--no-export"]


def _submit(env: dict, log: Path, driver: list[str]) -> str:
    cmd = ["sbatch", "--parsable", "--nodes=2", "--time=00:30:00", "--job-name=megarl-test", f"--output={log}",
           str(SCRIPT), *driver]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip().split(";")[0]


def _job(job: str, env: dict) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _job_processes(job: str) -> list[tuple[int, str, str]]:
    """(pid, command line, node) of every live process a job started."""
    found = []
    for proc in psutil.process_iter():
        try:
            environ = proc.environ()
            if environ.get("SLURM_JOB_ID") == job and proc.status() != psutil.STATUS_ZOMBIE:
                found.append((proc.pid, " ".join(proc.cmdline()), environ.get("SLURMD_NODENAME", "?")))
        except (psutil.Error, OSError):
            pass
    return found


def _wait(job: str, env: dict, timeout_s: float, until=None, every=None, poll_s: float = 1.0) -> dict[str, str]:
    """Poll every ``poll_s`` until the job reaches a final state (or ``until(info)`` is true);
    ``every()`` runs at each poll. On timeout the job is cancelled and the test fails."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = _job(job, env)
        if every is not None:
            every()
        if info.get("JobState") in FINAL or (until is not None and until(info)):
            return info
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=env)
            pytest.fail(f"job {job} still {info.get('JobState')} after {timeout_s:.0f} s (cancelled)")
        time.sleep(poll_s)


def _no_leftovers(job: str, timeout_s: float = 30) -> list[tuple[int, str, str]]:
    deadline = time.monotonic() + timeout_s
    while (left := _job_processes(job)) and time.monotonic() < deadline:
        time.sleep(1)
    return left


def _log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no job log)"


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("fault", ["exits", "hangs"])
def test_a_node_whose_ray_cannot_start_fails_the_job_fast_and_is_named(slurm_cluster, tmp_path, fault):
    # The fault, on n2 only: `ray start` fails (a broken install) or never joins (e.g. the head is
    # unreachable from it); everywhere else `ray` is the real one.
    broken = {"exits": 'echo "ray: broken installation on $(hostname)" >&2; exit 1',
              "hangs": 'echo "ray: $(hostname) cannot reach the head" >&2; exec sleep 600'}[fault]
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ray").write_text(f'#!/bin/bash\nif [ "$(hostname)" = n2 ] && [ "$1" = start ]; then '
                              f'{broken}; fi\nexec {VENV_BIN / "ray"} "$@"\n')
    (fake / "ray").chmod(0o755)
    env = _env(slurm_cluster, MEGARL_RAY_JOIN_TIMEOUT="30")
    env["PATH"] = f"{fake}:{env['PATH']}"
    log = tmp_path / "job.out"
    job = _submit(env, log, ["python", "-c", "print('the driver should not run')"])
    info = _wait(job, env, timeout_s=240, until=lambda i: i.get("JobState") == "RUNNING")
    started = time.monotonic()
    info = _wait(job, env, timeout_s=180)
    elapsed = time.monotonic() - started
    text = _log(log)
    assert info["JobState"] == "FAILED", f"job {job}: {info.get('JobState')}\n{text[-4000:]}"
    assert elapsed < 120, f"the job took {elapsed:.0f} s to fail\n{text[-4000:]}"
    error = [line for line in text.splitlines() if "ERROR" in line]
    assert any("n2" in line for line in error), text[-4000:]
    assert "the driver should not run" not in text
    assert _no_leftovers(job) == [], "processes of the failed job still running"


def test_two_node_training_job_is_preempted_requeued_and_resumed(slurm_cluster, prompts, tmp_path):
    env = _env(slurm_cluster, MEGARL_VENV=str(VENV_BIN.parent))
    out, log = tmp_path / "run", tmp_path / "job.out"
    # Steps take 0.2-1.5 s here: the signal must come while the run still has steps to do (it comes
    # within ~1 s of the first checkpoint, watched closely), and every step after the requeue costs
    # its time again: 20 steps leave a margin of 18.
    steps = 20
    job = _submit(env, log, _train_args(prompts, out, **{"trainer.total_steps": steps, "trainer.save_every": 1}))
    seen: dict[str, set[str]] = {}

    def snapshot():
        for _, cmdline, node in _job_processes(job):
            for name in ("ray::MegatronWorker", "ray::RolloutWorker", "raylet", "gcs_server", "megarl train"):
                if name in cmdline:
                    seen.setdefault(name, set()).add(node)

    first = out / "checkpoints" / "step_000001" / "trainer_state.json"
    _wait(job, env, timeout_s=420, until=lambda i: first.is_file(), poll_s=0.1)
    assert _job(job, env).get("JobState") == "RUNNING", _log(log)[-4000:]
    # What Slurm does at --signal=B:USR1@<secs> before the time limit: USR1 to the batch shell.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True)
    info = _wait(job, env, timeout_s=480, every=snapshot)  # the processes of the resumed run
    text = _log(log)
    assert info["JobState"] == "COMPLETED", f"job {job}: {info.get('JobState')}\n{text[-6000:]}"
    assert "preflight: 2 node(s), backend gloo: OK" in text and "all 2 Ray nodes joined" in text, text[-3000:]
    # Each node's raylet ran one Megatron rank: the workers ran on both nodes; the driver on the head.
    assert seen.get("ray::MegatronWorker") == {"n1", "n2"}, seen
    assert seen.get("raylet") == {"n1", "n2"}, seen
    assert seen.get("megarl train") == {"n1"}, seen
    assert int(info["Restarts"]) >= 1, info
    assert "requeueing job" in text and "SIGTERM received" in text, text[-6000:]
    resumed = re.search(r"megarl: resumed from \S+step_(\d+) \(step (\d+)\)", text)
    assert resumed and 1 <= int(resumed.group(2)) < steps, text[-6000:]
    assert f"megarl train: stopped at step {resumed.group(2)}/{steps}" in text, text[-6000:]
    done = [m["step"] for m in _metrics(out)]
    assert done == list(range(1, steps + 1)), done  # numbering continues across the requeue; no step ran twice
    assert _no_leftovers(job) == [], "processes of the finished job still running"


def test_a_ray_node_lost_mid_run_is_named_and_the_driver_stopped(slurm_cluster, tmp_path):
    # The driver stands in for the trainer: it runs until SIGTERM, then "saves" and exits.
    driver = tmp_path / "driver.py"
    driver.write_text("import signal, sys, time\n"
                      "signal.signal(signal.SIGTERM, lambda *_: (print('driver: SIGTERM, saving', flush=True), "
                      "sys.exit(0)))\n"
                      "print('driver: running', flush=True)\n"
                      "time.sleep(300)\n")
    env = _env(slurm_cluster, MEGARL_PREFLIGHT="0")
    log = tmp_path / "job.out"
    job = _submit(env, log, ["python", str(driver)])
    _wait(job, env, timeout_s=240, until=lambda i: "driver: running" in _log(log))
    # The fault: n2's raylet dies (a crash, the OOM killer).
    raylets = [pid for pid, cmdline, node in _job_processes(job) if node == "n2" and "/raylet " in f"{cmdline} "]
    assert raylets, _job_processes(job)
    for pid in raylets:
        os.kill(pid, 9)
    started = time.monotonic()
    info = _wait(job, env, timeout_s=120)
    text = _log(log)
    assert info["JobState"] == "FAILED", f"job {job}: {info.get('JobState')}\n{text[-4000:]}"
    assert time.monotonic() - started < 60, text[-4000:]
    assert "ERROR: Ray on node n2 ended while the driver ran" in text, text[-4000:]
    assert "driver: SIGTERM, saving" in text, text[-4000:]
    assert _no_leftovers(job) == [], "processes of the failed job still running"
