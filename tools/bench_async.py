#!/usr/bin/env python
"""Benchmark rollout modes side by side: the quickstart GRPO run with the engines on a pool of
their own, once per ``rollout.mode``, on the same cores, model, prompts and samples. Prints a table.

    .venv/bin/python tools/bench_async.py [--modes sync,one_step_off,streaming,control] [--max-staleness 2]
        [--steps 12] [--warmup 2] [--length 16] [--rounds 2] [--workdir runs/bench_async] [--plot]

Each run: the quickstart config (tiny-qwen2, 16 prompts x 8 samples per step) on
``cluster.cpu_ranks_per_node=2`` split into a training pool of 1 rank (actor and reference) and
a rollout pool of 1 rank (one SGLang engine), completions of exactly ``--length`` tokens
(``rollout.ignore_eos``). Samples/s is 128 over the median step time of the steps after ``--warmup``
(from ``metrics.jsonl``); the reward is the mean over the last 3 steps. Rounds alternate which
mode runs first (this machine's speed drifts within minutes). The ratio is each mode's samples/s
over sync's in the same round; the table shows the median over rounds. ``control`` is the sync
run without learning (lr 1e-12: Adam moves each weight by ~1e-12), the reward every mode must rise
above. ``--plot`` draws each run's timeline (``tools/plot_timeline.py``) next to it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SAMPLES_PER_STEP = 16 * 8


def run_mode(mode: str, out: Path, args: argparse.Namespace) -> dict:
    """One ``megarl train`` run in ``mode``; its per-step times and rewards."""
    from megarl.data.prepare import write_synthetic_arith

    data = out.parent / "arith.parquet"
    if not data.is_file():
        write_synthetic_arith(data, 2000, seed=0, partial_credit_scale=5)
    overrides = {
        "data.train_files": f"[{data}]", "trainer.output_dir": str(out), "trainer.loggers": "[console]",
        "trainer.total_steps": args.warmup + args.steps, "trainer.save_every": 0, "trainer.resume": "none",
        "cluster.cpu_ranks_per_node": 2, "cluster.pools": "{train: 1, rollout: 1}", "actor.pool": "train",
        "rollout.placement": "separate", "rollout.pool": "rollout", "rollout.mode": "sync" if mode == "control" else mode,
        **({"rollout.max_staleness": args.max_staleness} if mode == "streaming" else {}),
        **({"actor.optim.lr": 1e-12} if mode == "control" else {}),
        "rollout.ignore_eos": "true", "rollout.max_new_tokens": args.length, "data.max_prompt_length": 16,
        "actor.micro_batch_size": 32, "ref.micro_batch_size": 32,
    }
    command = [sys.executable, "-m", "megarl.cli", "train", str(ROOT / "configs/quickstart_grpo.yaml"), "--no-export",
               *[f"{k}={v}" for k, v in overrides.items()]]
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"bench_async: {mode} run failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][args.warmup:]
    if args.plot:
        subprocess.run([sys.executable, str(ROOT / "tools/plot_timeline.py"), str(out / "timeline.json"),
                        "--steps", f"{args.warmup + 1}-{args.warmup + 4}"], check=True)
    step_s = statistics.median(m["time/step_s"] for m in steps)
    return {"mode": mode, "step_s": step_s, "samples_per_s": SAMPLES_PER_STEP / step_s,
            "generation_s": statistics.median(m["time/generation_s"] for m in steps),
            "update_s": statistics.median(m["time/update_s"] for m in steps),
            "reward_last3": statistics.mean(m["reward/mean"] for m in steps[-3:]),
            "lag_mean": statistics.mean(m["rollout/version_lag_mean"] for m in steps),
            "wall_s": time.monotonic() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="sync,one_step_off,streaming,control")
    parser.add_argument("--max-staleness", type=int, default=2, help="rollout.max_staleness of streaming")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps excluded from the times")
    parser.add_argument("--length", type=int, default=16, help="tokens per completion")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workdir", default="runs/bench_async")
    parser.add_argument("--plot", action="store_true", help="draw each run's timeline as a PNG")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if "sync" not in modes:
        modes = ["sync", *modes]  # the ratios' reference
    rounds = []
    for r in range(args.rounds):
        order = modes if r % 2 == 0 else modes[::-1]
        results = {mode: run_mode(mode, Path(args.workdir) / f"round{r}" / mode, args) for mode in order}
        rounds.append(results)
        print(f"round {r + 1}: " + ", ".join(f"{m} {results[m]['samples_per_s']:.1f} samples/s" for m in modes),
              flush=True)
    print(f"\n{'mode':<14} {'samples/s':>10} {'vs sync':>8} {'gen s':>7} {'update s':>9} {'lag':>5} {'reward':>7}")
    for mode in modes:
        col = lambda key: statistics.median(r[mode][key] for r in rounds)  # noqa: E731
        ratio = statistics.median(r[mode]["samples_per_s"] / r["sync"]["samples_per_s"] for r in rounds)
        print(f"{mode:<14} {col('samples_per_s'):>10.1f} {ratio:>7.2f}x {col('generation_s'):>7.2f} "
              f"{col('update_s'):>9.2f} {col('lag_mean'):>5.2f} {col('reward_last3'):>7.3f}")
    (Path(args.workdir) / "bench_async.json").write_text(json.dumps(rounds, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
