"""launch_scripts/convert_llama70b.sbatch for real on the local two-node Slurm: one `megarl convert`
rank per Slurm task (srun, env:// rendezvous on the first node), HF -> Megatron -> HF of a tiny
Llama at tp=2 over two nodes; the exported HF tensors equal the original ones bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.launch_scripts.conftest import job_leftovers

ROOT = Path(__file__).resolve().parents[2]


def test_convert_job_round_trip_on_two_nodes(slurm_cluster, tmp_path):
    from safetensors.torch import load_file

    from model_specs.presets import save_tiny_hf_model

    hf = save_tiny_hf_model("tiny-llama", tmp_path / "hf", seed=3)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(slurm_cluster, DIRECTION="both", TP="2", PP="1", HF_PATH=hf, MEGATRON_PATH=str(tmp_path / "mcore"),
               HF_OUT_PATH=str(tmp_path / "back"), MASTER_PORT="29533",
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    log = tmp_path / "job.out"
    # The script's 4 x 8 tasks, 8 CPUs each are overridden for the 2-CPU test nodes.
    job = subprocess.run(["sbatch", "--parsable", "--exclusive", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1",
                          "--time=00:10:00", f"--output={log}", str(ROOT / "launch_scripts/convert_llama70b.sbatch")],
                         env=env, cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    deadline, state = time.monotonic() + 240, "?"
    while time.monotonic() < deadline:
        out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
        state = next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "?")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        time.sleep(1)
    else:
        subprocess.run(["scancel", job], env=env)
    text = log.read_text() if log.exists() else "(no job log)"
    assert state == "COMPLETED", f"job {job}: {state}\n{text[-5000:]}"
    assert job_leftovers(job) == [], "processes of the job still running"
    assert "(on 2 ranks, rendezvous " in text and ":29533)" in text
    assert text.count("logit probe passed") == 2  # both directions verified themselves
    original = load_file(str(Path(hf) / "model.safetensors"))
    back = {}
    for f in sorted((tmp_path / "back").glob("*.safetensors")):
        back.update(load_file(str(f)))
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and back[name].equal(tensor), name
