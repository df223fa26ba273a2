"""`megarl check-config` in a subprocess: exit codes, messages, and no heavy imports on its path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from megarl.config import CONFIGS_DIR

REPO = Path(__file__).resolve().parents[3]
QUICKSTART = CONFIGS_DIR / "quickstart_grpo.yaml"
HEAVY = ("megatron", "ray", "sglang", "transformers")

# Runs the CLI's main() and reports which heavy packages got imported on the way.
_PROBE = (
    "import sys; from megarl.cli import main; rc = main(sys.argv[1:]); "
    f"print('HEAVY=' + ','.join(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))), file=sys.stderr); "
    "sys.exit(rc)"
)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _PROBE, "check-config", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_valid_config_prints_the_resolved_yaml_and_exits_0():
    # --skip-file-checks between overrides: overrides on both sides of it apply, in order.
    result = _run(str(QUICKSTART), "rollout.n=8", "--skip-file-checks", "actor.optim.lr=2e-6", "rollout.n=6")
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["rollout"]["n"] == 6 and resolved["actor"]["optim"]["lr"] == 2e-6
    assert resolved["algorithm"]["advantage"] == "grpo" and "defaults" not in resolved
    assert "HEAVY=\n" in result.stderr  # no megatron / ray / sglang / transformers import


def test_bad_config_exits_2_with_one_line_per_problem(tmp_path):
    result = _run(str(QUICKSTART), "actor.optim.lr=0", "algorithm.advantage=nope",
                  "data.train_files=[/no/such/file.parquet]")
    assert result.returncode == 2 and result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if not line.startswith("HEAVY=")]
    assert len(lines) == 3 and all(line.startswith("megarl: config error: ") for line in lines)
    assert lines[0].startswith("megarl: config error: actor.optim.lr=0.0: the learning rate must be > 0")
    assert lines[1].startswith('megarl: config error: algorithm.advantage="nope": unknown advantage estimator')
    assert lines[2].startswith('megarl: config error: data.train_files[0]="/no/such/file.parquet": the file does not exist')
    assert "HEAVY=\n" in result.stderr


def test_structural_errors_exit_2_before_importing_torch(tmp_path):
    bad = tmp_path / "run.yaml"
    bad.write_text("defaults: [algorithm/grpo]\nrollout: {n: eight}\nactor: {optim: {learning_rate: 1.0e-6}}\n")
    probe = _PROBE.replace("& set(", "& set(('torch',) + ")
    result = subprocess.run([sys.executable, "-c", probe, "check-config", str(bad)], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "megarl: config error: actor.optim.learning_rate: unknown key" in result.stderr
    assert 'megarl: config error: rollout.n="eight": expected an integer, got a string' in result.stderr
    assert "HEAVY=\n" in result.stderr  # not even torch
