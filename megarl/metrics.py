"""Per-step metrics: ``metrics.jsonl`` always, TensorBoard and the console when configured.

The console line is a running summary: the step, reward (or an SFT run's loss) and its mean over
the last steps, the phase times and throughput, so a user watching a run sees at once whether it learns and where
the time goes.
"""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path

CONSOLE_KEYS = (("reward/mean", "reward"), ("actor/nll", "nll"), ("response_length/mean", "len"), ("actor/entropy", "entropy"),
                ("actor/kl_loss", "kl"), ("actor/clipfrac", "clip"), ("actor/grad_norm", "gnorm"),
                ("critic/vf_loss", "vf_loss"), ("actor/mismatch/abs_logp_diff", "logp_diff"),
                ("time/step_s", "s/step"), ("throughput/tokens_per_s", "tok/s"))


class MetricsLogger:
    """Writes every step's metrics to ``run_dir/metrics.jsonl`` (appending: a resumed run adds
    to it) and to the configured loggers ("console", "tensorboard"). ``headline``: (metric, short
    name) whose running mean the console line ends with."""

    def __init__(self, run_dir: str | Path, loggers: list[str], total_steps: int, window: int = 5,
                 headline: tuple[str, str] = ("reward/mean", "reward")):
        self.run_dir = Path(run_dir)
        self.headline = headline
        self.total_steps = total_steps
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")
        self.console = "console" in loggers
        self.recent = deque(maxlen=window)
        self.started = time.monotonic()
        self.tensorboard = None
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"))

    def log(self, metrics: dict[str, float]) -> None:
        step = int(metrics["step"])
        self.jsonl.write(json.dumps(metrics, sort_keys=True) + "\n")
        self.jsonl.flush()
        if self.tensorboard is not None:
            for key, value in metrics.items():
                if key != "step":
                    self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.console:
            self.recent.append(metrics.get(self.headline[0], float("nan")))
            parts = [f"{short} {metrics[key]:.4g}" for key, short in CONSOLE_KEYS if key in metrics]
            running = sum(self.recent) / len(self.recent)
            elapsed = time.monotonic() - self.started
            print(f"step {step:4d}/{self.total_steps}  " + "  ".join(parts)
                  + f"  | {self.headline[1]}(last {len(self.recent)}) {running:.3f}  elapsed {elapsed:.0f}s", flush=True)

    def close(self) -> None:
        self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
