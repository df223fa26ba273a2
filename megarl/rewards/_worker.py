"""The reward worker process and the result check shared by every backend.

Kept free of torch and of heavy imports so that a fresh worker starts in a fraction of a
second. A worker first reads a list of ``"module:function"`` strings to import, answers
``("ready", pid)``, then reads ``(task_id, function_ref, kwargs)`` from its socket, calls the function,
and answers ``(task_id, "ok", (score, extras))`` or ``(task_id, "error", message)``; ``None``
stops it. ``function_ref`` is a ``"module:function"`` string (loaded and cached here) or a
callable pickled by reference.
"""

from __future__ import annotations

import math
import numbers
import os
import signal

# What a worker process runs: ``python -c WORKER_CODE <fd of its end of the socket pair>``.
WORKER_CODE = (
    "import sys; from multiprocessing.connection import Connection; "
    "from megarl.rewards._worker import main; main(Connection(int(sys.argv[1])))"
)


def check_result(value) -> tuple[float, dict[str, float]]:
    """A reward function's return value as ``(score, extras)``: a real number, or a dict with a
    real ``"score"`` and other real-valued entries. ValueError for anything else or non-finite."""
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward dict has no 'score' key (keys: {sorted(value)})")
        for key, item in value.items():
            if key != "score" and _is_real(item):
                extras[str(key)] = float(item)
        value = value["score"]
    if not _is_real(value):
        raise ValueError(f"reward must be a real number or a dict with 'score', got {type(value).__name__}: {value!r:.80}")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"reward is not finite: {score}")
    return score, extras


def _is_real(value) -> bool:
    if isinstance(value, numbers.Real):
        return True
    # numpy / torch scalars without importing either
    return hasattr(value, "item") and getattr(value, "ndim", None) == 0 and not isinstance(value, (str, bytes))


def _call_ref(fn_ref, cache: dict):
    if not isinstance(fn_ref, str):
        return fn_ref
    fn = cache.get(fn_ref)
    if fn is None:
        from megarl.rewards.registry import resolve_reward

        fn = cache[fn_ref] = resolve_reward(fn_ref)
    return fn


def _call(fn_ref, kwargs, cache: dict):
    return check_result(_call_ref(fn_ref, cache)(**kwargs))


def main(conn) -> None:
    """Worker loop; ``conn`` is a ``multiprocessing.connection.Connection`` (see ``WORKER_CODE``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the controller's to handle
    cache: dict = {}
    try:
        preload = conn.recv()  # "module:function" strings to import before the first call
    except (EOFError, OSError):
        return
    for spec in preload:
        try:
            _call_ref(spec, cache)
        except Exception:  # reported by the call that needs it
            pass
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        except Exception as exc:  # the task could not be unpickled here (e.g. its module is missing)
            conn.send((None, "error", f"worker could not load the task: {type(exc).__name__}: {exc}"))
            continue
        if msg is None:
            return
        task_id, fn_ref, kwargs = msg
        try:
            reply = (task_id, "ok", _call(fn_ref, kwargs, cache))
        except BaseException as exc:  # noqa: BLE001 - a user function's failure is data here
            reply = (task_id, "error", f"{type(exc).__name__}: {exc}")
        try:
            conn.send(reply)
        except Exception as exc:
            conn.send((task_id, "error", f"result could not be sent back: {type(exc).__name__}: {exc}"))

