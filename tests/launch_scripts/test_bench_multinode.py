"""tools/bench_multinode.py: the report and --compare (no Slurm), and a real 2-node sbatch job on
the local Slurm cluster (ci/slurm_up.sh): collectives between the two nodes, then two tiny
`megarl train` steps on CPU through the Ray-on-Slurm bootstrap, reported as JSON + table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import bench_multinode  # noqa: E402

from tests.launch_scripts.conftest import job_leftovers  # noqa: E402

STEP = {"step": 1, "time/step_s": 2.0, "time/generate_s": 1.0, "time/update_s": 0.5, "time/sync_s": 0.25,
        "throughput/tokens_per_s": 100.0, "throughput/generated_tokens_per_s": 40.0,
        "perf/train_tflops_per_s": 0.002, "sync/bytes": 1000.0}


def test_summary_numbers():
    rows = [dict(STEP, step=1, **{"time/update_s": 9.0}), dict(STEP, step=2), dict(STEP, step=3)]
    s = bench_multinode.summarize_metrics(rows, warmup=1, ranks=2, peak_tflops_per_rank=0.01)
    assert s["steps"] == [2, 3]  # the warm-up step is left out
    assert s["generation_tokens_per_s"] == 40.0
    assert s["training_tokens_per_s"] == 100.0 * 2.0 / 0.5  # the step's tokens over the update time
    assert s["mfu"] == pytest.approx(0.002 / (2 * 0.01))
    assert s["sync_seconds"] == 0.25 and s["sync_bytes"] == 1000.0 and s["sync_bytes_per_s"] == 4000.0
    assert s["phase_seconds"] == {"generate": 1.0, "sync": 0.25, "update": 0.5}


def test_compare_scaling_efficiency(tmp_path, capsys):
    def run(nodes: int, gen: float) -> str:
        training = bench_multinode.summarize_metrics([dict(STEP, **{"throughput/generated_tokens_per_s": gen})],
                                                     0, nodes, 1.0)
        path = tmp_path / f"bench_multinode_{nodes}nodes.json"
        path.write_text(json.dumps({"nodes": nodes, "training": training}))
        return str(path)

    paths = [run(4, 60.0), run(2, 40.0)]
    assert bench_multinode.main(["--compare", *paths]) == 0
    out = capsys.readouterr().out
    header, *rows = out.splitlines()
    assert header.split()[1:] == ["2", "nodes", "4", "nodes"]  # sorted by node count
    assert "scaling eff. generation" in out
    line = next(r for r in rows if r.startswith("scaling eff. generation"))
    assert line.split()[-4:] == ["100", "%", "75", "%"]  # base 100 %; (60/40) / (4/2) = 75 %


def _wait(job: str, env: dict, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    state = "?"
    while time.monotonic() < deadline:
        out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
        state = next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "?")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"):
            return state
        time.sleep(1)
    subprocess.run(["scancel", job], env=env)
    return f"still {state} after {timeout_s:.0f} s (cancelled)"


@pytest.fixture
def slurm_env(slurm_cluster) -> dict:
    """Slurm client environment (tests/launch_scripts/conftest.py's cluster), not inside any other job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(slurm_cluster)
    return env


def test_two_node_bench_job(slurm_env, tmp_path):
    """sbatch --nodes=2 launch_scripts/bench_multinode.sbatch: JSON + table with sane numbers."""
    env = slurm_env
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env["MEGARL_RAY_NUM_CPUS"] = "1"  # one Megatron rank per Ray node: the two ranks land on both nodes
    env["MEGARL_NET_IFACE"] = "lo"  # both "nodes" are this host (names on 127.0.0.11/12): they share lo
    data = tmp_path / "train.parquet"
    subprocess.run([sys.executable, str(ROOT / "tools/prepare_data.py"), "synthetic-arith", "--output", str(data),
                    "--num", "64"], check=True, capture_output=True)
    out_dir = tmp_path / "bench"
    log = tmp_path / "job.out"
    # --exclusive: no other job's Ray (same ports, `ray stop` at its end) shares the two nodes.
    submit = ["sbatch", "--parsable", "--nodes=2", "--exclusive", f"--output={log}", "--time=00:10:00",
              str(ROOT / "launch_scripts/bench_multinode.sbatch"),
              "--config", "configs/quickstart_grpo.yaml", "--out-dir", str(out_dir), "--warmup", "1", "--steps", "1",
              "--size-mb", "4", "--iters", "3", "--",
              f"data.train_files=[{data}]", "cluster.cpu_ranks_per_node=1", "data.batch_size=4", "rollout.n=2",
              "actor.micro_batch_size=4", "ref.micro_batch_size=4", "rollout.max_new_tokens=2",
              "trainer.loggers=[console]"]
    job = subprocess.run(submit, env=env, cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    job = job.split(";")[0]
    state = _wait(job, env, timeout_s=300)
    text = log.read_text() if log.exists() else "(no job log)"
    assert state == "COMPLETED", f"job {job}: {state}\n{text[-6000:]}"
    assert job_leftovers(job) == [], "processes of the job still running"

    result = json.loads((out_dir / "bench_multinode_2nodes.json").read_text())
    table = (out_dir / "bench_multinode_2nodes.txt").read_text()
    assert result["nodes"] == 2 and result["ranks"] == 2
    c = result["collectives"]
    assert c["backend"] == "gloo" and c["world"] == 2 and len(c["hosts"]) == 2
    assert len(set(c["hosts"])) == 2, c["hosts"]  # one task on each node
    for op in ("all_reduce", "all_gather"):
        assert c[op]["bytes"] == 4 * 2**20 and c[op]["seconds"] > 0 and c[op]["busbw_GBps"] > 0
    t = result["training"]
    assert t["steps"] == [2]
    for key in ("generation_tokens_per_s", "training_tokens_per_s", "step_tokens_per_s", "train_tflops_per_s",
                "mfu", "sync_seconds", "sync_bytes", "step_seconds"):
        assert t[key] is not None and t[key] > 0, (key, t)
    assert t["mfu"] < 1
    assert set(t["phase_seconds"]) >= {"generate", "update", "sync"}
    plan = result["sync_plan"]
    assert t["sync_bytes"] == plan["network_bytes"] + plan["local_bytes"]  # the trainer synced what the plan says
    for label in ("generation tokens/s", "training tokens/s", "MFU", "weight sync s", "all_reduce 4 MiB (gloo)"):
        assert label in table
