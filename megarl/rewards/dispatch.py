"""Score a batch of responses: pick each sample's reward function by data source, run it with a
per-call timeout, and never let a failing or hung function stop the run.

``compute_rewards(data_sources, responses, ground_truths, extra_infos)`` returns a float32 tensor
of scores and a dict of statistics. A call that raises, returns something that is not a finite
number, or runs longer than ``timeout_s`` scores 0.0; the counts go into the statistics
(``num_errors``, ``num_timeouts``) and one warning per batch is logged. ``RewardRunner`` is the
same with worker processes kept alive across steps (use it in a training loop).

Where each function runs (``backend``):

* ``"process"``: in a pool of worker processes (fresh interpreters, kept between batches). The
  controller tracks each call's start; a call past ``timeout_s`` has its worker killed
  (SIGKILL) and replaced, so even a busy loop or a C extension that never returns is stopped.
  Functions travel by reference: registered names, ``"module:function"`` strings and
  module-level functions work; lambdas and closures are refused when the runner is built.
* ``"thread"``: each call in a daemon thread; a call past the timeout is abandoned (scored 0.0,
  counted) but keeps running in the background, since Python cannot kill a thread. No
  pickling; for functions that cannot be sent to a process.
* ``"inline"``: in the calling thread; exceptions are caught, there is no timeout.
* ``"auto"`` (default): trusted registered rewards (the built-ins) inline, everything else
  (user functions) in processes.

Which function scores a sample: ``reward_fns[data_source]`` if given, else the reward
registered for that data source, else ``default``; a data source with none of these is a
ValueError before anything runs.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from megarl.rewards import _worker, registry
from megarl.rewards import builtin as _builtin  # noqa: F401  (registers the built-ins)

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "process", "thread", "inline")

# An outcome of one call: ("ok", (score, extras)) | ("error", message) | ("timeout", None)
Outcome = tuple[str, Any]


@dataclass(frozen=True)
class _Resolved:
    label: str  # how the function was named, for messages
    fn: Callable
    ref: Any  # what is sent to a worker process: a spec string or the callable
    trusted: bool


def _resolve(spec: str | Callable) -> _Resolved:
    if isinstance(spec, str):
        fn = registry.resolve_reward(spec)
        trusted = spec in registry.registered_rewards() and registry.is_trusted(spec)
        ref = fn if spec in registry.registered_rewards() else spec
        return _Resolved(spec, fn, ref, trusted)
    if callable(spec):
        label = f"{getattr(spec, '__module__', '?')}.{getattr(spec, '__qualname__', repr(spec))}"
        return _Resolved(label, spec, spec, False)
    raise ValueError(f"a reward function must be a name, a 'module:function' string or a callable, got {spec!r}")


class _ProcessPool:
    """Worker processes with exact per-call deadlines; a worker past its deadline is killed.

    Workers are fresh interpreters (``python -c _worker.WORKER_CODE``) talking over a socket
    pair, not ``multiprocessing`` children: they never re-import the caller's ``__main__`` (which
    may be a notebook, stdin or a Ray actor) and inherit no threads or locks by forking. A new
    worker imports the ``preload`` functions and says it is ready before it gets a call, so
    interpreter start-up never counts against a call's timeout.
    """

    def __init__(self, num_workers: int, preload: Sequence[str] = (), startup_timeout_s: float = 120.0):
        self._num_workers = num_workers
        self._preload = list(preload)
        self._startup_timeout_s = startup_timeout_s
        self._idle: list[tuple[Any, Any]] = []  # (process, connection)
        self.num_killed = 0
        self.crash_next_call = False  # fault injection (megarl.faults): SIGKILL the worker of the next call

    def _spawn(self):
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        # The worker imports user modules by name: give it the caller's import path.
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _worker.WORKER_CODE, str(child_sock.fileno())],
                pass_fds=(child_sock.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        finally:
            child_sock.close()
        conn = multiprocessing.connection.Connection(parent_sock.detach())
        conn.send(self._preload)
        return proc, conn

    def _start_workers(self, count: int) -> str | None:
        """Start ``count`` workers at once and wait until each is ready; the error if none is."""
        starting = {}
        for _ in range(count):
            worker = self._spawn()
            starting[worker[1]] = worker
        deadline = time.monotonic() + self._startup_timeout_s
        error = None
        while starting:
            ready = multiprocessing.connection.wait(list(starting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                error = f"reward worker did not start within {self._startup_timeout_s} s"
                break
            for conn in ready:
                worker = starting.pop(conn)
                try:
                    conn.recv()  # ("ready", pid)
                    self._idle.append(worker)
                except (EOFError, OSError):
                    error = f"reward worker process exited at start-up (exit code {worker[0].wait()})"
                    self._kill(worker)
        for worker in starting.values():
            self._kill(worker)
        return error if not self._idle else None

    @staticmethod
    def _kill(worker) -> None:
        proc, conn = worker
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        conn.close()

    def run(self, tasks: Sequence[tuple[Any, dict]], timeout_s: float | None) -> list[Outcome]:
        results: list[Outcome | None] = [None] * len(tasks)
        todo = deque(range(len(tasks)))
        busy: dict[Any, tuple[tuple[Any, Any], int, float]] = {}  # conn -> (worker, task, start)
        width = max(1, min(self._num_workers, len(tasks)))
        try:
            while todo or busy:
                wanted = min(width - len(busy), len(todo)) - len(self._idle)
                if wanted > 0:
                    error = self._start_workers(wanted)
                    if error is not None and not busy:
                        while todo:
                            results[todo.popleft()] = ("error", error)
                        break
                while todo and self._idle and len(busy) < width:
                    worker = self._idle.pop()
                    idx = todo.popleft()
                    if self.crash_next_call:  # dead before the call reaches it, whatever the timing
                        self.crash_next_call = False
                        worker[0].kill()
                        worker[0].wait()
                    try:
                        worker[1].send((idx, *tasks[idx]))
                    except (BrokenPipeError, ConnectionError, EOFError):
                        self._kill(worker)
                        results[idx] = ("error", "reward worker process died before the call")
                        continue
                    except Exception as exc:  # the task itself cannot be pickled
                        results[idx] = ("error", f"cannot send the call to a worker: {type(exc).__name__}: {exc}")
                        self._idle.append(worker)
                        continue
                    busy[worker[1]] = (worker, idx, time.monotonic())
                if not busy:
                    continue
                wait_s = None
                if timeout_s is not None:
                    first_deadline = min(start for _, _, start in busy.values()) + timeout_s
                    wait_s = max(0.0, first_deadline - time.monotonic())
                for conn in multiprocessing.connection.wait(list(busy), timeout=wait_s):
                    worker, idx, _ = busy.pop(conn)
                    try:
                        _, status, payload = conn.recv()
                    except (EOFError, OSError):
                        self._kill(worker)
                        results[idx] = ("error", f"reward worker process died (exit code {worker[0].poll()})")
                        continue
                    results[idx] = (status, payload)
                    self._idle.append(worker)
                if timeout_s is not None:
                    now = time.monotonic()
                    for conn, (worker, idx, start) in list(busy.items()):
                        if now - start >= timeout_s:
                            del busy[conn]
                            self._kill(worker)
                            self.num_killed += 1
                            results[idx] = ("timeout", None)
        finally:
            for worker, _, _ in busy.values():  # interrupted: do not leave calls running
                self._kill(worker)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        workers, self._idle = self._idle, []
        for _proc, conn in workers:
            try:
                conn.send(None)
            except Exception:
                pass
        for worker in workers:
            try:
                worker[0].wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
            self._kill(worker)


def _run_in_threads(
    tasks: Sequence[tuple[Callable, dict]], timeout_s: float | None, num_workers: int
) -> tuple[list[Outcome], int]:
    """Run calls in daemon threads, at most ``num_workers`` at once; abandon those past the
    timeout. Returns the outcomes and the number of abandoned (still running) calls."""
    results: list[Outcome | None] = [None] * len(tasks)
    done: queue.SimpleQueue = queue.SimpleQueue()

    def target(idx: int, fn: Callable, kwargs: dict) -> None:
        try:
            done.put((idx, "ok", _worker.check_result(fn(**kwargs))))
        except BaseException as exc:  # noqa: BLE001
            done.put((idx, "error", f"{type(exc).__name__}: {exc}"))

    todo = deque(range(len(tasks)))
    running: dict[int, float] = {}
    abandoned = 0
    width = max(1, num_workers)
    while todo or running:
        while todo and len(running) < width:
            idx = todo.popleft()
            fn, kwargs = tasks[idx]
            threading.Thread(target=target, args=(idx, fn, kwargs), daemon=True, name="megarl-reward").start()
            running[idx] = time.monotonic()
        wait_s = None
        if timeout_s is not None:
            wait_s = max(0.0, min(running.values()) + timeout_s - time.monotonic())
        try:
            idx, status, payload = done.get(timeout=wait_s)
            if idx in running:  # not already abandoned
                del running[idx]
                results[idx] = (status, payload)
        except queue.Empty:
            pass
        if timeout_s is not None:
            now = time.monotonic()
            for idx, start in list(running.items()):
                if now - start >= timeout_s:
                    del running[idx]
                    results[idx] = ("timeout", None)
                    abandoned += 1
    return results, abandoned  # type: ignore[return-value]


class RewardRunner:
    """Scores batches; keeps its worker processes between calls. Use as a context manager or
    call ``close()``.

    Args:
        reward_fns: data source -> reward (registered name, ``"module:function"``, callable);
            takes precedence over the registered data-source mapping.
        default: the reward for data sources with no mapping (else those are a ValueError).
        timeout_s: per-call limit in seconds (None: no limit); ignored by ``inline``.
        backend: ``"auto"``, ``"process"``, ``"thread"`` or ``"inline"`` (module docstring).
        num_workers: concurrent calls (default: CPU count, at most 8).
    """

    def __init__(
        self,
        reward_fns: Mapping[str, str | Callable] | None = None,
        default: str | Callable | None = None,
        timeout_s: float | None = 10.0,
        backend: str = "auto",
        num_workers: int | None = None,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"reward backend must be one of {BACKENDS}, got {backend!r}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"reward timeout_s must be > 0 or None, got {timeout_s!r}")
        self.backend = backend
        self.timeout_s = timeout_s
        self.num_workers = num_workers or min(8, os.cpu_count() or 1)
        # Resolve user functions now: a typo'd module fails before any generation runs.
        self._overrides = {ds: _resolve(spec) for ds, spec in (reward_fns or {}).items()}
        self._default = _resolve(default) if default is not None else None
        self._cache: dict[str, _Resolved] = {}
        for resolved in [*self._overrides.values(), *([self._default] if self._default else [])]:
            self._check_sendable(resolved)
        self._pool: _ProcessPool | None = None
        self.num_abandoned_threads = 0
        self._crash_next_call = False

    def crash_a_worker_in_the_next_batch(self) -> None:
        """Fault injection (``megarl.faults``, ``kill_reward_worker``): the worker process that is
        to run the next batch's first process call is SIGKILLed just before the call."""
        self._crash_next_call = True

    def _runs_in_process(self, resolved: _Resolved) -> bool:
        return self.backend == "process" or (self.backend == "auto" and not resolved.trusted)

    def _check_sendable(self, resolved: _Resolved) -> None:
        if not self._runs_in_process(resolved) or isinstance(resolved.ref, str):
            return
        try:
            pickle.dumps(resolved.ref)
        except Exception as exc:
            raise ValueError(
                f"reward function {resolved.label} cannot be sent to a worker process ({type(exc).__name__}: {exc}); "
                "define it at module level and name it 'module:function', or use backend='thread'"
            ) from exc

    def resolve(self, data_source: str) -> _Resolved:
        """The reward function that scores ``data_source`` (ValueError if there is none)."""
        if data_source in self._overrides:
            return self._overrides[data_source]
        if data_source not in self._cache:
            name = registry.reward_for_data_source(data_source)
            if name is not None:
                self._cache[data_source] = _resolve(name)
            elif self._default is not None:
                self._cache[data_source] = self._default
            else:
                known = sorted(registry.data_source_mapping())
                raise ValueError(
                    f"no reward function for data source {data_source!r}; registered data sources: {known}. "
                    f"Pass reward_fns={{{data_source!r}: 'my_module:my_function'}} or default=..., or register "
                    "one with @register_reward(name, data_sources=...)"
                )
            self._check_sendable(self._cache[data_source])
        return self._cache[data_source]

    def __call__(
        self,
        data_sources: Sequence[str],
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[dict | None] | None = None,
    ):
        """Scores (float32 tensor ``[n]``) and statistics for ``n`` responses."""
        import torch

        n = len(responses)
        if extra_infos is None:
            extra_infos = [None] * n
        if not (len(data_sources) == len(ground_truths) == len(extra_infos) == n):
            raise ValueError(
                f"compute_rewards: lengths differ: data_sources {len(data_sources)}, responses {n}, "
                f"ground_truths {len(ground_truths)}, extra_infos {len(extra_infos)}"
            )
        fns = [self.resolve(ds) for ds in data_sources]
        kwargs = [
            dict(data_source=ds, solution_str=resp, ground_truth=gt, extra_info=dict(info or {}))
            for ds, resp, gt, info in zip(data_sources, responses, ground_truths, extra_infos)
        ]
        outcomes: list[Outcome | None] = [None] * n
        groups: dict[str, list[int]] = {"process": [], "thread": [], "inline": []}
        for i, resolved in enumerate(fns):
            kind = "process" if self._runs_in_process(resolved) else ("thread" if self.backend == "thread" else "inline")
            groups[kind].append(i)
        if groups["process"]:
            if self._pool is None:
                named = [*self._overrides.values(), *([self._default] if self._default else [])]
                preload = sorted({f.ref for f in named if isinstance(f.ref, str)})
                self._pool = _ProcessPool(self.num_workers, preload=preload)
            tasks = [(fns[i].ref, kwargs[i]) for i in groups["process"]]
            self._pool.crash_next_call, self._crash_next_call = self._crash_next_call, False
            for i, out in zip(groups["process"], self._pool.run(tasks, self.timeout_s)):
                outcomes[i] = out
        if groups["thread"]:
            tasks = [(fns[i].fn, kwargs[i]) for i in groups["thread"]]
            results, abandoned = _run_in_threads(tasks, self.timeout_s, self.num_workers)
            self.num_abandoned_threads += abandoned
            for i, out in zip(groups["thread"], results):
                outcomes[i] = out
        for i in groups["inline"]:
            try:
                outcomes[i] = ("ok", _worker.check_result(fns[i].fn(**kwargs[i])))
            except Exception as exc:  # noqa: BLE001
                outcomes[i] = ("error", f"{type(exc).__name__}: {exc}")
        if self._crash_next_call:
            raise ValueError("fault injection kill_reward_worker: no reward of this batch runs in a worker process; "
                             "inject it into a run whose reward runs in processes (reward.backend: process)")
        scores, stats = self._summarise(outcomes, fns, data_sources)
        return torch.tensor(scores, dtype=torch.float32), stats

    def _summarise(self, outcomes, fns, data_sources) -> tuple[list[float], dict[str, float]]:
        scores: list[float] = []
        extras: dict[str, list[float]] = {}
        failures: list[str] = []
        timeouts = errors = 0
        for (status, payload), resolved in zip(outcomes, fns):
            if status == "ok":
                score, extra = payload
                for key, value in extra.items():
                    extras.setdefault(key, []).append(value)
            else:
                score = 0.0
                if status == "timeout":
                    timeouts += 1
                    failures.append(f"{resolved.label}: timed out after {self.timeout_s} s")
                else:
                    errors += 1
                    failures.append(f"{resolved.label}: {payload}")
            scores.append(score)
        n = len(scores)
        stats: dict[str, float] = {
            "num_samples": float(n),
            "num_timeouts": float(timeouts),
            "num_errors": float(errors),
            "score_mean": sum(scores) / n if n else 0.0,
            "score_min": min(scores) if n else 0.0,
            "score_max": max(scores) if n else 0.0,
        }
        by_source: dict[str, list[float]] = {}
        for ds, score in zip(data_sources, scores):
            by_source.setdefault(ds, []).append(score)
        if len(by_source) > 1:
            for ds, values in sorted(by_source.items()):
                stats[f"score_mean/{ds}"] = sum(values) / len(values)
        for key, values in sorted(extras.items()):
            stats[f"extra/{key}"] = sum(values) / len(values)
        if failures:
            logger.warning(
                "reward: %d of %d calls failed and scored 0.0 (%d timed out after %s s, %d raised or returned "
                "a non-number); first: %s",
                timeouts + errors,
                n,
                timeouts,
                self.timeout_s,
                errors,
                failures[0],
            )
        return scores, stats

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def compute_rewards(
    data_sources: Sequence[str],
    responses: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict | None] | None = None,
    **runner_kwargs,
):
    """Score one batch with a fresh ``RewardRunner(**runner_kwargs)`` (closed afterwards).

    Returns ``(scores, stats)``: a float32 tensor ``[n]`` and a dict with ``num_samples``,
    ``num_timeouts``, ``num_errors``, ``score_mean/min/max``, ``score_mean/<data source>`` when
    there are several, and ``extra/<key>`` means of extra numbers returned in dicts.
    """
    with RewardRunner(**runner_kwargs) as runner:
        return runner(data_sources, responses, ground_truths, extra_infos)
