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
   the job fails and leaves nothing running;
d. a node whose slurmd dies mid-job (its job steps keep running, so Slurm cannot end its Ray):
   the teardown finds the job's Ray processes left there and stops them through MEGARL_NODE_SHELL,
   naming the node and the processes; without a node shell the job fails naming the node and
   what may be left on it;
e. a wrong override of a `megarl train` driver fails the job in seconds, before any Ray process;
f. node names that resolve to loopback addresses (without MEGARL_NET_IFACE) fail the job in
   seconds, naming the head and the variable to set, before the preflight and Ray.

Jobs are watched by polling `scontrol show job` (sbatch --wait polls slowly). Processes are
attributed to a job by SLURM_JOB_ID in their environment (conftest.job_processes: inherited by
everything a job starts, Ray's daemons and workers included); no test leaves one running.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallel.spawn import free_port
from tests.launch_scripts.conftest import job_leftovers, job_processes, kill_slurmd, restart_slurmd

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
    # Both "nodes" are this host, their names mapped to 127.0.0.11/12: the loopback interface is
    # the one they share, chosen explicitly (a loopback address is refused otherwise).
    env.update(PATH=f"{VENV_BIN}:{env['PATH']}", MEGARL_RAY_NUM_CPUS="1", MEGARL_GPUS_PER_NODE="0", MEGARL_NET_IFACE="lo",
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


def _wait(job: str, env: dict, timeout_s: float, until=None, every=None, poll_s: float = 1.0) -> dict[str, str]:
    """Poll every ``poll_s`` until the job reaches a final state (or ``until(info)`` is true);
    ``every()`` runs at each poll. On timeout the job is cancelled and the test fails."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = _job(job, env)
        job_processes(job)  # (records the job's process groups: conftest.job_processes)
        if every is not None:
            every()
        if info.get("JobState") in FINAL or (until is not None and until(info)):
            return info
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=env)
            pytest.fail(f"job {job} still {info.get('JobState')} after {timeout_s:.0f} s (cancelled)")
        time.sleep(poll_s)


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
    assert job_leftovers(job) == [], "processes of the failed job still running"


def test_two_node_training_job_is_preempted_requeued_and_resumed(slurm_cluster, prompts, tmp_path):
    env = _env(slurm_cluster, MEGARL_VENV=str(VENV_BIN.parent))
    out, log = tmp_path / "run", tmp_path / "job.out"
    # Steps take 0.2-1.5 s here (plus a checkpoint each): the signal must come while the run still
    # has steps to do (it comes within ~1 s of the first checkpoint, watched closely), and every step
    # after the requeue costs its time again: 10 steps leave a margin of 8.
    steps = 10
    job = _submit(env, log, _train_args(prompts, out, **{"trainer.total_steps": steps, "trainer.save_every": 1}))
    seen: dict[str, set[str]] = {}

    def snapshot():
        for _, cmdline, node in job_processes(job):
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
    assert "inter-node all_reduce ok over 2 node(s), 2 ranks" in text, text[-3000:]  # timed, between the nodes
    assert re.search(r"node IPs: n1=127\.0\.0\.11\(lo\) n2=127\.0\.0\.12\(lo\)", text), text[-3000:]
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
    assert job_leftovers(job) == [], "processes of the finished job still running"


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
    raylets = [pid for pid, cmdline, node in job_processes(job) if node == "n2" and "/raylet " in f"{cmdline} "]
    assert raylets, job_processes(job)
    for pid in raylets:
        os.kill(pid, 9)
    started = time.monotonic()
    info = _wait(job, env, timeout_s=120)
    text = _log(log)
    assert info["JobState"] == "FAILED", f"job {job}: {info.get('JobState')}\n{text[-4000:]}"
    assert time.monotonic() - started < 60, text[-4000:]
    assert "ERROR: Ray on node n2 ended while the driver ran" in text, text[-4000:]
    assert "driver: SIGTERM, saving" in text, text[-4000:]
    assert job_leftovers(job) == [], "processes of the failed job still running"


def _run_seconds(info: dict[str, str]) -> int:
    days, _, clock = info["RunTime"].rpartition("-")
    h, m, s = (int(x) for x in clock.split(":"))
    return (int(days or 0) * 24 + h) * 3600 + m * 60 + s


def _exit_status(text: str) -> int | None:
    found = re.findall(r"^\[ray_on_slurm [\d:]+\] exit status (\d+)$", text, re.MULTILINE)
    return int(found[-1]) if found else None


@pytest.mark.parametrize("node_shell", [True, False], ids=["node-shell", "no-node-shell"])
def test_ray_on_a_node_whose_slurmd_died_is_stopped_or_the_job_fails_naming_it(slurm_cluster, tmp_path, node_shell):
    # The driver runs until the test lets it finish (after n2's slurmd is gone), then exits 0.
    go, driver = tmp_path / "go", tmp_path / "driver.py"
    driver.write_text("import pathlib, time\n"
                      f"go = pathlib.Path({str(go)!r})\n"
                      "print('driver: running', flush=True)\n"
                      "deadline = time.monotonic() + 120\n"
                      "while not go.exists() and time.monotonic() < deadline:\n"
                      "    time.sleep(0.2)\n"
                      "print('driver: done', flush=True)\n")
    # Slurm cannot end n2's Ray step: 5 s for the steps (n1's ends at once), then the node checks.
    extra = dict(MEGARL_PREFLIGHT="0", MEGARL_RAY_STOP_WAIT="5", MEGARL_NODE_CHECK_TIMEOUT="10")
    if node_shell:
        # Both "nodes" are this host, so a local command reaches n2's processes (a cluster: ssh).
        extra["MEGARL_NODE_SHELL"] = "env MEGARL_CHECKED_NODE={node}"
    env = _env(slurm_cluster, **extra)
    log = tmp_path / "job.out"
    job = _submit(env, log, ["python", str(driver)])
    _wait(job, env, timeout_s=240, until=lambda i: "driver: running" in _log(log))
    on_n2 = [cmdline for _, cmdline, node in job_processes(job) if node == "n2"]
    assert any("/raylet " in f"{c} " for c in on_n2), job_processes(job)
    try:
        kill_slurmd("n2")  # its slurmstepds, and the Ray step they run, keep running
        go.touch()
        started = time.monotonic()
        while _exit_status(_log(log)) is None and time.monotonic() - started < 120:
            time.sleep(0.5)
        elapsed = time.monotonic() - started
        text = _log(log)
        left = [p for p in job_processes(job) if p[2] == "n2"]
        assert _exit_status(text) is not None, f"the job script did not end within 120 s\n{text[-4000:]}"
        # Well within SlurmdTimeout (60 s), after which Slurm would declare n2 down and fail the job itself.
        assert elapsed < 50, f"teardown took {elapsed:.0f} s\n{text[-4000:]}"
        assert "driver: done" in text and "driver exited with status 0" in text, text[-4000:]
        teardown = text[text.index("stopping Ray on"):]
        assert "n2: its Ray step did not end through Slurm within 5s" in teardown, teardown
        if node_shell:
            stopped = re.search(r"n2: Slurm did not end this job's Ray there; stopped \(via MEGARL_NODE_SHELL\): (.*)",
                                teardown)
            assert stopped and "raylet" in stopped.group(1), teardown
            assert f"Ray is down: no Ray process of job {job} left on n1 n2" in teardown, teardown
            assert "ERROR" not in teardown, teardown
            assert _exit_status(text) == 0, teardown
            assert left == [], f"processes of the job left on n2 after its teardown: {left}"
        else:
            assert re.search(r"ERROR: n2: cannot verify that this job's Ray processes ended there: srun cannot reach "
                             r"it .*no MEGARL_NODE_SHELL.*Ray processes recorded there at start: .*raylet", teardown), \
                teardown
            assert f"ERROR: teardown: Ray processes of job {job} may be left on n2 (see above); none left on n1" \
                in teardown, teardown
            assert "Ray is down" not in teardown, teardown
            assert _exit_status(text) == 1, teardown
            assert any("/raylet " in f"{c} " for _, c, _ in left), left  # what it reported is what is there
    finally:
        for pid, _, node in job_processes(job):  # what the job left on n2 (the failure case), before slurmd returns
            if node != "n2":
                continue
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        restart_slurmd("n2", env)
    info = _wait(job, env, timeout_s=120)
    assert info["JobState"] == ("COMPLETED" if node_shell else "FAILED"), f"job {job}: {info}\n{text[-3000:]}"
    assert job_leftovers(job) == [], "processes of the job still running"


def test_a_wrong_override_fails_the_job_in_seconds_before_any_ray_process(slurm_cluster, prompts, tmp_path):
    env = _env(slurm_cluster)
    log = tmp_path / "job.out"
    job = _submit(env, log, _train_args(prompts, tmp_path / "run", **{"actor.micro_batch_sise": 4}))
    ray = []

    def watch():
        ray.extend(p for p in job_processes(job)
                   if any(name in p[1] for name in ("ray start", "raylet", "gcs_server", "ray::", "megarl preflight")))

    info = _wait(job, env, timeout_s=240, every=watch, poll_s=0.2)
    text = _log(log)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", f"job {job}: {info}\n{text[-3000:]}"
    assert _run_seconds(info) <= 15, f"ran {info['RunTime']}\n{text[-3000:]}"
    assert "config error: actor.micro_batch_sise: unknown key; did you mean actor.micro_batch_size?" in text, text
    assert "ERROR: the driver's config is invalid" in text, text
    for later in ("node IPs", "preflight on", "starting the Ray head", "stopping Ray"):
        assert later not in text, text
    assert ray == [], f"Ray processes of the job appeared: {ray}"
    assert job_leftovers(job) == [], "processes of the job still running"


def test_a_head_name_resolving_to_loopback_fails_the_job_naming_the_variable(slurm_cluster, tmp_path):
    env = _env(slurm_cluster)
    del env["MEGARL_NET_IFACE"]  # n1 and n2 resolve to 127.0.0.11/12: other machines could not reach them
    log = tmp_path / "job.out"
    job = _submit(env, log, ["python", "-c", "print('the driver should not run')"])
    info = _wait(job, env, timeout_s=240)
    text = _log(log)
    assert info["JobState"] == "FAILED", f"job {job}: {info}\n{text[-3000:]}"
    assert _run_seconds(info) <= 30, f"ran {info['RunTime']}\n{text[-3000:]}"
    assert "ERROR: the head node's name n1 resolves to no address but loopback on n2 (getent ahostsv4 n1): " \
           "set MEGARL_NET_IFACE to the interface the nodes share" in text, text[-3000:]
    for later in ("preflight on", "starting the Ray head", "the driver should not run"):
        assert later not in text, text
    assert job_leftovers(job) == [], "processes of the job still running"
