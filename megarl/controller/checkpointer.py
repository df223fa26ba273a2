"""A run's checkpoints: atomic saves with checksum manifests, resume (damaged ones skipped,
elastic layout changes allowed) and the final HF export.

``checkpoints/step_<k>`` holds every Megatron rank's model and optimizer state (Megatron
distributed checkpoints, resharded on load) and ``trainer_state.json``: the step, the config
fingerprint it may be resumed against, and the run state its trainer keeps (data position, KL
controller).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Callable

from megarl.config.schema import RunConfig
from megarl.controller.worker_group import RunError, WorkerGroup
from megarl.faults import FaultPlan

CHECKPOINT_DIR = "checkpoints"
STATE_FILE = "trainer_state.json"

ELASTIC_KEYS = ("actor_layout", "critic_layout", "cluster")  # fingerprint keys an elastic resume may change
ELASTIC_NOTE = (
    "Models and optimizer states are resharded by Megatron's distributed checkpoints (the same values); the "
    "step, learning-rate schedule, data position and KL controller are global and restored. Not identical to an "
    "uninterrupted run: rollout sampling when the number of engines changed, and the fp32 rounding of reductions "
    "split over other ranks")


def config_fingerprint(cfg: RunConfig) -> dict:
    """What a checkpoint is resumed against: the model, which roles run, and where (the layouts and
    cluster, ``ELASTIC_KEYS``: those may change, see ``RunCheckpointer.resume``)."""
    return {"model": cfg.model.path, "dtype": cfg.model.dtype,
            "actor_layout": dataclasses.asdict(cfg.actor.layout), "cluster": dataclasses.asdict(cfg.cluster),
            "critic_layout": dataclasses.asdict(cfg.layout_for("critic")) if cfg.critic.enabled else None,
            "critic": cfg.critic.enabled, "ref": cfg.ref.enabled}


def resume_changes(saved: dict, cfg: RunConfig, path: Path) -> str:
    """What ``cfg`` changes of the fingerprint a checkpoint at ``path`` was ``saved`` with, as one
    line ("" if nothing): only where the models run (``ELASTIC_KEYS``) may change; RunError
    naming anything else."""
    changed = {k: (saved.get(k), v) for k, v in config_fingerprint(cfg).items() if saved.get(k) != v}

    def line(keys) -> str:
        return "; ".join(f"{k}: checkpoint {changed[k][0]!r}, config {changed[k][1]!r}" for k in keys)

    fixed = [k for k in changed if k not in ELASTIC_KEYS]
    if fixed:
        raise RunError(f"cannot resume from {path}: the config changed ({line(fixed)}). Resume with the "
                       "checkpoint's settings, or set trainer.resume=none / a new trainer.output_dir")
    return line(changed)


def complete_checkpoints(out: Path) -> list[Path]:
    """The complete checkpoints under the run directory ``out``, oldest first."""
    root = out / CHECKPOINT_DIR
    done = [p for p in root.glob("step_*") if (p / STATE_FILE).is_file()] if root.is_dir() else []
    return sorted(done, key=lambda p: int(p.name.split("_")[1]))


def resume_hint(out: Path) -> str:
    """What an error tells the user to do to go on from the run directory ``out``."""
    found = complete_checkpoints(out)
    return (f"The newest complete checkpoint is {found[-1]}: run the same command to resume from it" if found
            else "No checkpoint was saved yet")


class RunCheckpointer:
    """Saves and resumes the checkpoints of the run writing to ``cfg.trainer.output_dir``."""

    def __init__(self, cfg: RunConfig, workers: WorkerGroup, faults: FaultPlan, log: Callable[[str], None]):
        self.cfg, self.workers, self.faults, self.log = cfg, workers, faults, log
        self.out = Path(cfg.trainer.output_dir)

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        return complete_checkpoints(self.out)

    def save(self, step: int, run_state: dict) -> Path:
        """Write ``checkpoints/step_<k>`` atomically (the hidden ``.step_<k>.partial``, renamed
        when complete; a killed save's is removed by the next) with a manifest of its files'
        checksums, written last, and keep the last K. A failed save (a full disk) keeps the
        previous checkpoints and stops the run (RunError) saying so."""
        from parallel.checkpoint.atomic import atomic_directory, partial_dir
        from parallel.checkpoint.manifest import write_manifest

        target = self.out / CHECKPOINT_DIR / f"step_{step:06d}"
        if target.exists():
            return target
        try:
            with atomic_directory(target, partial=partial_dir(target)) as partial:
                self.workers.call("save_checkpoint", str(partial))
                self._inject_save_fault(step, partial)
                state = {"step": step, "fingerprint": config_fingerprint(self.cfg), **run_state}
                (partial / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True))
                write_manifest(partial, checksums=self.cfg.trainer.checkpoint_checksums)
        except Exception as exc:  # noqa: BLE001 - a worker's OSError arrives wrapped by Ray
            previous = self.checkpoints()
            kept = f"the newest complete checkpoint, {previous[-1]}, is intact" if previous else "no checkpoint was kept"
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]  # Ray's: the traceback's last line
            raise RunError(f"saving {target} failed ({why}); nothing "
                           f"of it was kept and {kept}. Free space under {target.parent} (or lower trainer.keep_last) "
                           "and run the same command to resume") from exc
        for old in self.checkpoints()[: -self.cfg.trainer.keep_last or None]:
            shutil.rmtree(old, ignore_errors=True)
        self.log(f"megarl: saved {target}")
        return target

    def _inject_save_fault(self, step: int, partial: Path) -> None:
        """Fault injection between the workers' shards and the state file: the driver killed
        (``kill_driver_during_save``) or a full disk (``checkpoint_enospc``)."""
        if self.faults.fire("kill_driver_during_save", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.faults.fire("checkpoint_enospc", step):
            raise OSError(errno.ENOSPC, "No space left on device (injected: MEGARL_FAULTS)", str(partial))

    def resume_checkpoint(self) -> Path | None:
        """The checkpoint ``trainer.resume`` names, checked against its manifest: with ``auto`` the
        newest intact one (each newer one skipped is logged with what is wrong with it, and moved
        aside to ``.step_<k>.damaged``); RunError if the named one, or every one found, is damaged."""
        from parallel.checkpoint.manifest import manifest_problem

        resume = self.cfg.trainer.resume
        if resume == "none":
            return None
        found = self.checkpoints()
        if resume != "auto":
            problem = (f"{STATE_FILE} is missing" if not (Path(resume) / STATE_FILE).is_file()
                       else manifest_problem(resume))
            if problem:
                raise RunError(f"trainer.resume={resume}: not an intact megarl checkpoint: {problem}; pick one of "
                               f"{[str(p) for p in found]} or set trainer.resume=none")
            return Path(resume)
        problems, damaged = [], []
        for path in reversed(found):
            problem = manifest_problem(path)
            if problem is None:
                for bad in damaged:  # aside, so that this run's save of that step can take its place
                    aside = bad.with_name(f".{bad.name}.damaged")
                    shutil.rmtree(aside, ignore_errors=True)
                    bad.rename(aside)
                    self.log(f"megarl: moved the damaged checkpoint {bad} to {aside}")
                return path
            problems.append(f"{path.name}: {problem}")
            damaged.append(path)
            self.log(f"megarl: skipping checkpoint {path}: {problem}")
        if problems:
            raise RunError(f"no intact checkpoint in {self.out / CHECKPOINT_DIR} to resume from ({'; '.join(problems)}); "
                           "restore one, or set trainer.resume=none to start over")
        return None

    def resume(self) -> tuple[Path, dict] | None:
        """Load the checkpoint to resume from into the workers (None if there is none): its path,
        and its state (``step``, and the run state its trainer saved)."""
        path = self.resume_checkpoint()
        if path is None:
            return None
        state = json.loads((path / STATE_FILE).read_text())
        changed = resume_changes(state["fingerprint"], self.cfg, path)
        rng_restored = all(self.workers.call("load_checkpoint", str(path)))
        if changed:
            rng = "" if rng_restored else ", and RNG states (re-seeded from (seed, optimizer steps, rank))"
            self.log(f"megarl: elastic resume from {path}: {changed}. {ELASTIC_NOTE}{rng}")
        return path, state

    def export_hf(self, target: str, tokenizer) -> str:
        """The actor as an HF checkpoint at ``target``, with ``tokenizer``."""
        if Path(target).exists():
            shutil.rmtree(target)
        self.workers.call("export_hf", target, role="actor")
        tokenizer.save_pretrained(target)
        return target
