#!/usr/bin/env python
"""Soak run: the quickstart GRPO for many steps with an SGLang engine killed every N steps
(``MEGARL_FAULTS=kill_engine@k,...``), checking that the run finishes with every step logged
exactly once and one engine restart per kill. Not part of the test suite (minutes of CPU).

    .venv/bin/python tools/soak.py [--steps 200] [--kill-every 40] [--workdir runs/soak] [key=value ...]

Extra ``key=value`` arguments are config overrides of ``configs/quickstart_grpo.yaml``. Prints the
steps, the restarts, the wall time and the reward at the start and end; exit status 0 when every
check holds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kill-every", type=int, default=40, help="an engine is killed at steps k, 2k, ... (< --steps)")
    parser.add_argument("--workdir", default="runs/soak")
    args, overrides = parser.parse_known_args(argv)
    from megarl.data.prepare import write_synthetic_arith

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "arith.parquet"
    if not data.is_file():
        write_synthetic_arith(data, 2000, seed=0, partial_credit_scale=5)
    out = work / f"run_{int(time.time())}"
    kills = list(range(args.kill_every, args.steps, args.kill_every))
    command = [sys.executable, "-m", "megarl.cli", "train", str(ROOT / "configs/quickstart_grpo.yaml"), "--no-export",
               f"data.train_files=[{data}]", f"trainer.output_dir={out}", f"trainer.total_steps={args.steps}",
               "trainer.loggers=[console]", "trainer.save_every=50", *overrides]
    env = {**os.environ, "MEGARL_FAULTS": ",".join(f"kill_engine@{k}" for k in kills)}
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    if done.returncode != 0:
        print(f"soak: the run failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}", file=sys.stderr)
        return 1
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [m["step"] for m in steps]
    restarts = {m["step"]: int(m["rollout/engine_restarts"]) for m in steps if m["rollout/engine_restarts"]}
    checks = {"every step logged once": logged == list(range(1, args.steps + 1)),
              "one restart per kill, at its step": restarts == {k: 1 for k in kills}}
    reward = lambda part: sum(m["reward/mean"] for m in part) / len(part)  # noqa: E731
    print(f"soak: {args.steps} steps in {wall:.0f} s, engines killed at steps {kills}, restarts at {sorted(restarts)}; "
          f"reward {reward(steps[:5]):.3f} (first 5 steps) -> {reward(steps[-5:]):.3f} (last 5)")
    for name, ok in checks.items():
        print(f"soak: {'ok    ' if ok else 'FAILED'} {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
