"""Fault injection for tests and soak runs, inert unless ``MEGARL_FAULTS`` is set.

``MEGARL_FAULTS="kill_engine@2,checkpoint_enospc@4"``: each entry fires once in the driver, at
the named (1-based) step.

- ``kill_engine@k`` SIGKILLs the processes of engine 0 just before step k's generation asks it for
  samples, as a crash would: the run must restart the engine, resync it and retry its requests
  (``RolloutManager.kill_engine``).
- ``checkpoint_enospc@k`` makes step k's checkpoint save fail with ENOSPC after the workers wrote
  their shards, as a full disk would: nothing of it may remain, the previous checkpoints must, and
  the run stops saying so (``RunCheckpointer.save``).
- ``kill_driver_during_save@k`` SIGKILLs the driver during step k's checkpoint save, after the
  workers wrote their shards: the checkpoint stays a hidden partial directory; the next run
  resumes from the newest complete checkpoint, drops the killed run's metrics of later steps and
  replaces the partial directory at its own save of step k (``RunCheckpointer.save``).
- ``kill_megatron_worker@k`` SIGKILLs the actor's last Megatron rank as step k's update begins
  (the kill is queued on the worker ahead of its update call), while the other ranks start the
  update and wait for it in a collective: the run must stop at once naming the rank and the phase,
  with the last complete checkpoint intact and named (``WorkerGroup.kill_rank``, ``gather``).
- ``kill_reward_worker@k`` SIGKILLs the reward worker process about to score step k's first
  sample, as a crash would: that sample scores 0 and counts in ``reward/num_errors``, a new worker
  takes over and the run goes on (``RewardRunner``). Only for rewards that run in worker
  processes (user functions, or ``reward.backend: process``).
"""

from __future__ import annotations

import os

ENV_VAR = "MEGARL_FAULTS"
KINDS = ("kill_engine", "checkpoint_enospc", "kill_driver_during_save", "kill_reward_worker",
         "kill_megatron_worker")


def planned_faults(spec: str | None = None) -> set[tuple[str, int]]:
    """The (kind, step) entries of ``spec`` (default: ``$MEGARL_FAULTS``); ValueError naming a bad one."""
    spec = os.environ.get(ENV_VAR, "") if spec is None else spec
    faults = set()
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        kind, _, step = entry.partition("@")
        if kind not in KINDS or not step.isdigit():
            raise ValueError(f"{ENV_VAR}: {entry!r} is not <kind>@<step> with a kind of {list(KINDS)}, "
                             "e.g. kill_engine@2; unset it for a normal run")
        faults.add((kind, int(step)))
    return faults


class FaultPlan:
    """The faults still to fire in this process."""

    def __init__(self, spec: str | None = None):
        self.pending = planned_faults(spec)

    def fire(self, kind: str, step: int) -> bool:
        """True once for each planned (kind, step)."""
        if (kind, step) in self.pending:
            self.pending.discard((kind, step))
            return True
        return False
