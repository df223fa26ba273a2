"""What every training run has, whatever it trains: the starting model and its tokenizer, the
Megatron workers, the checkpointer, the timeline and the fault plan, and the step loop with its
logging, periodic saves and SIGTERM handling. A trainer (``rl.RLTrainer``, ``sft.SFTTrainer``)
brings its data and its step, and calls ``Run.fit`` with itself as the ``StepProgram``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Callable, Protocol

from megarl.config.schema import RunConfig
from megarl.controller.checkpointer import RunCheckpointer, resume_hint
from megarl.controller.model_roles import model_specs
from megarl.controller.worker_group import RunError, WorkerGroup
from megarl.faults import FaultPlan
from megarl.metrics import MetricsLogger, Timeline

TIMELINE_FILE = "timeline.json"
# Seconds launch_scripts/ray_on_slurm.sh gives the driver between SIGTERM and SIGKILL
GRACE_ENV = "MEGARL_DRIVER_GRACE"


def grace_warning(step_s: float, save_s: float, grace: str | None) -> str | None:
    """What to tell the user when a preempted run could not save in time: on SIGTERM the driver
    finishes its step, then saves, within ``grace`` seconds (``MEGARL_DRIVER_GRACE``, None when
    not under the Slurm script). None while the last step and save fit with a quarter to spare."""
    if not grace:
        return None
    needed = step_s + save_s
    if needed <= 0.75 * float(grace):
        return None
    return (f"megarl: WARNING: a step ({step_s:.0f} s) and a checkpoint save ({save_s:.0f} s) take {needed:.0f} s, "
            f"more than 3/4 of the {float(grace):g} s a preempted driver gets after SIGTERM ({GRACE_ENV}); raise "
            f"{GRACE_ENV} and the sbatch --signal=B:USR1@<seconds> lead time above {needed / 0.75:.0f} s, or the "
            "preemption's checkpoint may be cut off (the run then resumes from the one before)")


class StepProgram(Protocol):
    """What ``Run.fit`` asks of a trainer."""

    HEADLINE: tuple[str, str]  # the metric the console line summarises, and its short name

    def train_step(self) -> dict[str, float]: ...
    def run_state(self) -> dict: ...  # what a checkpoint keeps beside the models
    def load_run_state(self, state: dict) -> None: ...  # after the workers loaded a checkpoint


def materialize_model(cfg: RunConfig) -> str:
    """The HF directory the run starts from: ``model.path`` itself, or for a preset name a tiny
    randomly initialised model with the character tokenizer, made once under the output dir."""
    from model_specs.presets import PRESETS, save_tiny_hf_model
    from model_specs.tokenizer import save_char_tokenizer
    from parallel.checkpoint.atomic import atomic_directory, partial_dir

    if Path(cfg.model.path).is_dir() or cfg.model.path not in PRESETS:
        return cfg.model.path
    target = Path(cfg.trainer.output_dir) / "initial_model"
    if not (target / "config.json").is_file():
        with atomic_directory(target, partial=partial_dir(target)) as partial:
            save_tiny_hf_model(cfg.model.path, partial, seed=cfg.trainer.seed, eos_token_id=1, pad_token_id=0)
            save_char_tokenizer(partial)
    return str(target)


class Run:
    """The shared machinery of a run of ``cfg`` (validated). ``start_workers`` starts Ray and
    builds the models; until then nothing expensive has happened (a trainer reads its data first,
    so a bad row fails before Ray starts)."""

    def __init__(self, cfg: RunConfig, log: Callable[[str], None] = print):
        from model_specs.tokenizer import load_tokenizer

        self.cfg, self.log = cfg, log
        self.out = Path(cfg.trainer.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.model_dir = materialize_model(cfg)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or self.model_dir)
        self.step = 0  # updates done
        self.timeline = Timeline(self.out / TIMELINE_FILE)
        try:
            self.faults = FaultPlan()
        except ValueError as exc:
            raise RunError(str(exc)) from None
        self.workers: WorkerGroup | None = None
        self._stop_requested = False

    def start_workers(self) -> None:
        """Ray, the Megatron workers of every role with their models built, and the checkpointer."""
        from parallel.checkpoint.hf_io import HFCheckpoint

        self.workers = WorkerGroup(self.cfg, self.log, self.faults, lambda: resume_hint(self.out))
        built = self.workers.setup(model_specs(self.cfg, self.model_dir), self.model_dir)
        self.actor_layer_spec = built[0]["layer_spec"]  # the actor's spec comes first
        self.hf_config = HFCheckpoint(self.model_dir).config
        self.checkpointer = RunCheckpointer(self.cfg, self.workers, self.faults, self.log)

    def fit(self, program: StepProgram, on_resume: Callable[[], None] = lambda: None) -> list[dict[str, float]]:
        """Run (or continue, from the checkpoint ``trainer.resume`` finds; ``on_resume`` runs once
        it is loaded) ``program``'s steps until ``trainer.total_steps``; this process's step metrics."""
        cfg = self.cfg
        resumed = self.checkpointer.resume()
        if resumed is not None:
            path, state = resumed
            program.load_run_state(state)
            self.step = state["step"]
            on_resume()
            self.log(f"megarl: resumed from {path} (step {self.step})")
        history = []
        logger = MetricsLogger(self.out, cfg.trainer.loggers, total_steps=cfg.trainer.total_steps,
                               headline=program.HEADLINE, first_step=self.step)
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        warned = False
        try:
            while self.step < cfg.trainer.total_steps:
                started = time.perf_counter()
                metrics = program.train_step()
                step_s = time.perf_counter() - started
                self.step += 1
                metrics["step"] = self.step
                history.append(metrics)
                if self.step % cfg.trainer.log_every == 0 or self.step == cfg.trainer.total_steps:
                    logger.log(metrics)
                last = self.step == cfg.trainer.total_steps
                if self._stop_requested or last or (cfg.trainer.save_every and self.step % cfg.trainer.save_every == 0):
                    started = time.perf_counter()
                    self.checkpointer.save(self.step, program.run_state())
                    warning = grace_warning(step_s, time.perf_counter() - started, os.environ.get(GRACE_ENV))
                    if warning and not warned:
                        self.log(warning)
                        warned = True
                if self._stop_requested:
                    self.log(f"megarl: SIGTERM: saved step {self.step}, exiting")
                    break
        finally:
            signal.signal(signal.SIGTERM, previous)
            logger.close()
        return history

    def _on_sigterm(self, signum, frame) -> None:
        self._stop_requested = True
        self.log("megarl: SIGTERM received: finishing this step, then saving a checkpoint")

    def export_hf(self, target: str | None = None) -> str:
        """The actor as an HF checkpoint (default ``<output_dir>/hf_final``)."""
        return self.checkpointer.export_hf(target or str(self.out / "hf_final"), self.tokenizer)

    def close(self) -> None:
        """Stop Ray (and with it every worker) if it runs."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
