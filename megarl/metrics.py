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
    """Writes every step's metrics to ``run_dir/metrics.jsonl`` and to the configured loggers
    ("console", "tensorboard"). A run that starts at ``first_step`` (a resumed run: the step of
    its checkpoint) continues the file from there: lines of later steps, logged by a run killed
    before it could save them, are dropped, so that every step is in the file once.
    ``headline``: (metric, short name) whose running mean the console line ends with."""

    def __init__(self, run_dir: str | Path, loggers: list[str], total_steps: int, window: int = 5,
                 headline: tuple[str, str] = ("reward/mean", "reward"), first_step: int = 0):
        self.run_dir = Path(run_dir)
        self.headline = headline
        self.total_steps = total_steps
        path = self.run_dir / "metrics.jsonl"
        if path.is_file():
            lines = path.read_text().splitlines()
            kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= first_step]
            if len(kept) != len(lines):
                from parallel.checkpoint.atomic import atomic_file

                with atomic_file(path) as partial:
                    partial.write_text("".join(line + "\n" for line in kept))
        self.jsonl = open(path, "a")
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


class Timeline:
    """Every phase's span as a Chrome/Perfetto trace, ``timeline.json`` in the run directory: a
    JSON array of complete events ("ph": "X", microseconds of wall time), one per line, appended
    as each phase ends (a resumed run continues the file; the array format lets the closing
    bracket be missing). Open it in ui.perfetto.dev or chrome://tracing, or draw it with
    ``tools/plot_timeline.py``. Lanes are threads of one process: "controller" (the step's
    phases) and "rollout" (generation, which may overlap them)."""

    LANES = ("controller", "rollout")

    def __init__(self, path: str | Path):
        import threading

        self.path = Path(path)
        self._lock = threading.Lock()
        new = not self.path.is_file() or self.path.stat().st_size == 0
        with open(self.path, "a") as f:
            if new:
                f.write("[\n" + "".join(json.dumps({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid,
                                                    "args": {"name": lane}}) + ",\n"
                                        for tid, lane in enumerate(self.LANES)))

    def span(self, name: str, lane: str, start: float, end: float, step: int) -> None:
        """One phase ``name`` on ``lane`` from ``start`` to ``end`` (``time.time()`` seconds)."""
        event = {"name": name, "ph": "X", "pid": 1, "tid": self.LANES.index(lane), "ts": round(start * 1e6),
                 "dur": round((end - start) * 1e6), "args": {"step": step}}
        with self._lock, open(self.path, "a") as f:
            f.write(json.dumps(event) + ",\n")


def read_timeline(path: str | Path) -> list[dict]:
    """The complete ("X") events of a ``Timeline`` file, each with its lane's name as ``lane``."""
    text = Path(path).read_text().rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return [dict(e, lane=lanes.get(e["tid"], str(e["tid"]))) for e in events if e.get("ph") == "X"]
