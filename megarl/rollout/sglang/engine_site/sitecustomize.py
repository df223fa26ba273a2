"""Interpreter-start hooks for the processes of a megarl SGLang engine (this directory,
``megarl.rollout.sglang.engine.SITE_DIR``, is put first on their PYTHONPATH; it is a plain directory, not
a package; SGLang spawns its scheduler/detokenizer children, which must be hooked before their first
import). Two independent hooks, each off unless its variable is "1":

``MEGARL_CPU_STUBS``
    install megarl's CPU import stubs (CPU engines only; see ``megarl/rollout/sglang/cpu/stubs.py``
    and ``megarl.rollout.sglang.engine.child_env``).
``MEGARL_SGLANG_SCHEDULER_PATCH``
    add ``Scheduler.megarl_reseed`` to SGLang's scheduler and batch the torch-native decode attention
    when they are imported (every device; see
    ``megarl.rollout.sglang.patches.install_scheduler_patch``).

Then the next ``sitecustomize`` on ``sys.path`` (one this file shadows, e.g. a distribution's)
runs as it would have without this directory.
"""

import os
import sys

if os.environ.get("MEGARL_CPU_STUBS", "") == "1":
    from megarl.rollout.sglang.cpu.stubs import install_from_env

    install_from_env()

if os.environ.get("MEGARL_SGLANG_SCHEDULER_PATCH", "") == "1":
    from megarl.rollout.sglang.patches import install_scheduler_patch

    install_scheduler_patch()


def _run_shadowed_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    entries = [os.path.abspath(p or os.curdir) for p in sys.path]
    if here not in entries:
        return
    later = [p for p in entries[entries.index(here) + 1:] if p != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is None or spec.loader is None or os.path.abspath(spec.origin or "") == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_run_shadowed_sitecustomize()
del _run_shadowed_sitecustomize
